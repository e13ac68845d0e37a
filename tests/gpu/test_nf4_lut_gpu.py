"""The NF4 register-table lookup in PTX (nf4_lut, ASM=True) over every byte value, fp16 and bf16:
bit-identical to the gather of the same table (CUDA only)."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from tests.kernels.test_nf4_lut import lookup_all_bytes  # noqa: E402
from whetstone_kernels.nf4_ref import nf4_code  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_register_table_every_byte(dtype):
    hi, lo, b = lookup_all_bytes(dtype, asm=True)
    code = nf4_code(b.device).to(dtype)
    assert torch.equal(hi.view(torch.int16), code[(b >> 4).long()].view(torch.int16))
    assert torch.equal(lo.view(torch.int16), code[(b & 15).long()].view(torch.int16))
    ghi, glo, _ = lookup_all_bytes(dtype, asm=False)
    assert torch.equal(hi.view(torch.int16), ghi.view(torch.int16)) and torch.equal(lo.view(torch.int16), glo.view(torch.int16))

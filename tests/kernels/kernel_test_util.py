import torch


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_close_lowp(k, ref, dtype):
    """Tolerance for Triton (fp32 math) vs a reference, per output dtype."""
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-10}[dtype]
    assert k.shape == ref.shape, (k.shape, ref.shape)
    assert torch.isfinite(k).all()
    assert rel_err(k, ref) < tol, rel_err(k, ref)

"""An export's provenance names the base by its public id, never by a server path."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from app.studio.artifacts import base_model_id
from worker.export.provenance import provenance, write_merged_provenance

LLAMA2C = "/work/shared/data/models/stories260K/stories260K.bin|/work/shared/data/models/stories260K/tok512.bin"


@pytest.fixture()
def info(tmp_path):
    base, adapter = tmp_path / "base-folder", tmp_path / "run" / "adapter"
    base.mkdir()
    adapter.mkdir(parents=True)
    (base / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"r": 8, "lora_alpha": 16, "target_modules": ["wq", "wk"]}))
    return SimpleNamespace(base_dir=base, adapter_dir=adapter, run_dir=tmp_path / "run",
                           load_in_4bit=False)


@pytest.mark.parametrize("base, want", [
    ({"name": "stories260K", "source": "llama2c", "source_ref": LLAMA2C},
     ("stories260K", None, "llama2c")),
    ({"name": "my-llama", "source": "local", "source_ref": "/srv/models/my-llama"},
     ("my-llama", None, "local")),
    ({"name": "tiny", "source": "hf", "source_ref": "karpathy/tinyllamas@abc123"},
     ("karpathy/tinyllamas", "abc123", "hf")),
    (None, ("base-folder", None, "local")),
])
def test_base_model_is_a_public_id(info, tmp_path, base, want):
    prov = provenance(info, base, "ftjob-1")
    assert (prov["base_model"], prov["base_model_revision"], prov["base_model_source"]) == want
    if base is not None:  # an adapter's config and card name the base as the export does
        assert base_model_id(SimpleNamespace(**base)) == want[0]
    folder = tmp_path / "merged"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    write_merged_provenance(folder, prov, "float32")
    card = (folder / "README.md").read_text()
    assert f"base_model: {json.dumps(want[0])}\n" in card
    assert str(tmp_path) not in card and "/work/" not in card and "/srv/" not in card


def test_gguf_metadata_names_the_base_without_a_path(info):
    from worker.export.gguf_writer import add_provenance

    calls: dict[str, tuple] = {}

    class Writer:
        def __getattr__(self, name):
            return lambda *args: calls.__setitem__(name, args)

    add_provenance(Writer(), provenance(info, {"name": "stories260K", "source": "llama2c",
                                               "source_ref": LLAMA2C}, "ftjob-1"))
    assert calls["add_base_model_name"] == (0, "stories260K")
    assert "add_base_model_repo_url" not in calls
    assert calls["add_description"][0].startswith("stories260K + LoRA adapter of run ftjob-1 (r=8")
    assert "/" not in calls["add_description"][0]

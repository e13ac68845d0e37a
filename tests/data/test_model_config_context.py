"""model_config.seq_longer_than_context: the SFT job's warning for a max_seq_length past the model's
context window (the fresh-user check found 100000 accepted silently for stories260K's 512)."""
from __future__ import annotations

import json

from app.data.model_config import seq_longer_than_context


def test_warns_only_past_the_context_window(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    assert seq_longer_than_context(512, folder, "m") is None
    msg = seq_longer_than_context(4096, folder, "stories260K")
    assert msg is not None and "max_seq_length 4096" in msg and "stories260K" in msg and "512" in msg
    assert seq_longer_than_context(4096, tmp_path / "none", "x") is None  # unknown window: silent

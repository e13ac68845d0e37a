"""Resume picks the newest COMPLETE checkpoint: folders written the way the HF Trainer writes
them (safetensors adapter, torch-saved optimizer/scheduler/RNG, trainer_state.json), one of
them cut short as a kill or a full disk leaves it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from worker.checkpoints import is_complete, newest_complete

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _checkpoint(root: Path, step: int) -> Path:
    d = root / f"checkpoint-{step}"
    d.mkdir(parents=True)
    safetensors_torch.save_file({"lora_A": torch.randn(8, 16), "lora_B": torch.zeros(16, 8)},
                                str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({"r": 8}))
    torch.save({"state": {0: {"exp_avg": torch.randn(64, 64)}}}, d / "optimizer.pt")
    torch.save({"last_epoch": step}, d / "scheduler.pt")
    torch.save({"python": list(range(100))}, d / "rng_state.pth")
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return d


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize("cut", ["optimizer.pt", "adapter_model.safetensors", "rng_state.pth",
                                 "trainer_state.json", None])
def test_resume_skips_a_half_written_checkpoint(tmp_path: Path, cut: str | None) -> None:
    older = _checkpoint(tmp_path, 10)
    newer = _checkpoint(tmp_path, 20)
    assert is_complete(older) and is_complete(newer)
    if cut is None:  # the trainer died before writing its state file at all
        (newer / "trainer_state.json").unlink()
    else:
        _truncate(newer / cut)
    skipped: list[str] = []
    assert newest_complete(tmp_path, skipped.append) == older
    assert skipped == ["checkpoint-20 is incomplete (its save was interrupted); set aside as "
                       ".incomplete-checkpoint-20"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".incomplete-checkpoint-20",
                                                          "checkpoint-10"]
    # a later attempt saving step 20 again, then looking again, finds it whole
    _checkpoint(tmp_path, 20)
    assert newest_complete(tmp_path) == tmp_path / "checkpoint-20"


def test_no_complete_checkpoint_means_start_over(tmp_path: Path) -> None:
    only = _checkpoint(tmp_path, 5)
    (only / "trainer_state.json").write_text(json.dumps({"global_step": 4}))  # another step's
    assert newest_complete(tmp_path) is None
    assert newest_complete(tmp_path / "missing") is None


def test_make_portable_rewrites_the_card_peft_writes(tmp_path: Path) -> None:
    """A checkpoint's README.md (PEFT: ``base_model: <folder>``, tag
    ``base_model:adapter:<folder>``) names the base as adapter_config.json does."""
    from app.store.schema import Model
    from worker.jobs.card import make_portable

    base = str(tmp_path / "data" / "models" / "stories260K")
    d = tmp_path / "checkpoint-74"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base}))
    (d / "README.md").write_text(f"---\nbase_model: {base}\nlibrary_name: peft\ntags:\n"
                                 f"- base_model:adapter:{base}\n- lora\n---\n{base}-v2 is another model\n")
    make_portable(d, Model(name="stories260K", source="llama2c", source_ref="/x/a.bin|/x/t.bin"))
    assert json.loads((d / "adapter_config.json").read_text())["base_model_name_or_path"] \
        == "stories260K"
    assert (d / "README.md").read_text() == ("---\nbase_model: stories260K\nlibrary_name: peft\n"
                                             "tags:\n- base_model:adapter:stories260K\n- lora\n"
                                             f"---\n{base}-v2 is another model\n")


def test_rotation_keeps_the_best_checkpoint_and_those_live_jobs_use(tmp_path: Path) -> None:
    """The job's rotation (worker.checkpoints.rotate, in the trainer's place) keeps the newest
    2, the trainer's best checkpoint (``load_best_model_at_end`` loads it at the end, as the
    trainer's own rotation keeps it) and the one a queued Playground session names; once the
    session has ended, the next rotation removes that one."""
    from app.store import queue
    from app.store.db import make_engine
    from app.store.migrate import upgrade
    from worker.checkpoints import rotate

    url = f"sqlite:///{tmp_path / 'w.db'}"
    upgrade(url)
    engine = make_engine(url)
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4, 5, 6):
        _checkpoint(root, step)
    session = queue.enqueue(engine, "playground", {"run_id": "r", "checkpoint_step": 3},
                            run_id="r")
    queue.enqueue(engine, "train", {"checkpoint_step": 1}, run_id="r")  # its own: no hold
    queue.enqueue(engine, "export", {"checkpoint_step": 2}, run_id="other")  # another run's
    kept = []
    removed = rotate(engine, "r", root, 2, lambda step, job: kept.append((step, job.id)),
                     best=str(root / "checkpoint-2"))
    assert removed == ["checkpoint-4", "checkpoint-1"]
    assert kept == [(3, session.id)]
    assert sorted(p.name for p in root.iterdir()) == [
        "checkpoint-2", "checkpoint-3", "checkpoint-5", "checkpoint-6"]
    assert queue.cancel(engine, session.id).state == "cancelled"
    assert rotate(engine, "r", root, 2) == ["checkpoint-3", "checkpoint-2"]
    assert rotate(engine, "r", root, 0) == []  # no limit: nothing removed
    engine.dispose()

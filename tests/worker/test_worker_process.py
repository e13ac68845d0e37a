"""The real worker process (``python -m worker``) on a temp data dir and SQLite file.

One module-scoped worker imports the demo model stories260K from shared/data, survives a job
that raises, trains ~30 LoRA steps on real data (loss falls, the adapter loads in PEFT and
changes greedy output), stops a running training job and a running export (its files removed)
within seconds of a cancel. Then SIGTERM puts a running job back in the queue (with a
checkpoint) and exits 0; a new worker resumes that job from the checkpoint.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (SHARED / "models" / "stories260K").exists(),
                                 reason=f"no test data at {SHARED}")]

from app.settings import Settings  # noqa: E402
from app.store import events, queue, repo, workers  # noqa: E402
from app.store.db import make_engine  # noqa: E402
from app.store.migrate import upgrade  # noqa: E402
from app.store.schema import Dataset, JobState  # noqa: E402
from app.store.specs import TrainSpec  # noqa: E402

SMALL = dict(max_seq_length=256, per_device_train_batch_size=2, gradient_accumulation_steps=1,
             learning_rate=1e-2, r=8, lora_alpha=16, warmup_ratio=0.0, logging_steps=1)


def _start(env: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "worker", "--poll-interval", "0.2", *args],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=open(env["WHETSTONE_DATA_DIR"] + "/worker.log", "ab"))


def _wait(pred, timeout: float, what: str, proc: subprocess.Popen | None = None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"worker exited ({proc.returncode}) while waiting for {what}")
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _ended(engine, job_id: int):
    j = queue.get_job(engine, job_id)
    return j if j.state in JobState.FINAL else None


def _first_metric(engine, job_id: int):
    return events.latest(engine, job_id, "metric")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("wdata")
    url = f"sqlite:///{d / 'whetstone.db'}"
    e = {**os.environ, "WHETSTONE_DATA_DIR": str(d), "WHETSTONE_DATABASE_URL": url,
         "WHETSTONE_SEED_DIR": str(SHARED), "WHETSTONE_HEARTBEAT_SECONDS": "0.3",
         "WHETSTONE_LEASE_SECONDS": "20", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
         "TOKENIZERS_PARALLELISM": "false"}
    upgrade(url)
    engine = make_engine(url)
    ds = repo.add_dataset(engine, Dataset(filename="identity_alpaca.json", format="alpaca",
                                          path=str(SHARED / "sft" / "identity_alpaca.json")))
    proc = _start(e, "--worker-id", "w-main")
    yield {"env": e, "engine": engine, "dir": d, "proc": proc, "dataset": ds.id}
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    engine.dispose()


def _run(env, **kw):
    spec = TrainSpec(model="stories260K", dataset=env["dataset"], **{**SMALL, **kw})
    return repo.create_run(env["engine"], spec)


def test_imports_demo_model_and_survives_a_failing_job(env) -> None:
    eng = env["engine"]
    m = _wait(lambda: (lambda m: m if m.status == "ready" else None)(
        repo.get_model(eng, "stories260K")) if repo.list_models(eng) else None, 120,
        "stories260K ready", env["proc"])
    assert m.info["params"] == 260032 and m.info["has_chat_template"] is False
    assert Path(m.path, "model.safetensors").exists()
    # two lanes: training on w-main, exports/imports/validation on its CPU lane
    assert sorted(w.id for w in workers.live(eng, 30)) == ["w-main", "w-main-cpu"]

    bad = queue.enqueue(eng, "import_model", {"spec_version": 1, "model_id": "model-nope"})
    j = _wait(lambda: _ended(eng, bad.id), 60, "failing job", env["proc"])
    assert j.state == JobState.FAILED
    assert "model-nope" in j.error and "\n" not in j.error
    logs = events.since(eng, bad.id, types=["log"])
    assert any("Traceback" in (ev.data.get("traceback") or "") for ev in logs)
    assert env["proc"].poll() is None  # still serving

    # its heartbeat row says whether it has CUDA (the web refuses QLoRA when no live worker
    # has); a QLoRA job it claims anyway fails at once, saying why and what to do instead
    if not workers.has_cuda(workers.live(eng, 30)[0]):
        _, qjob = _run(env, load_in_4bit=True, max_steps=1)
        j = _wait(lambda: _ended(eng, qjob.id), 60, "QLoRA job on the CPU", env["proc"])
        assert j.state == JobState.FAILED and j.attempts == 1
        assert j.error == ("QLoRA (load_in_4bit) needs a CUDA GPU with bitsandbytes; this worker "
                           "runs on the CPU. Turn load_in_4bit off to train LoRA in full "
                           "precision.")


def test_train_30_steps_loss_falls_and_adapter_works(env) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    eng = env["engine"]
    run, job = _run(env, max_steps=30, save_steps=10)
    j = _wait(lambda: _ended(eng, job.id), 240, "training", env["proc"])
    assert j.state == JobState.SUCCEEDED, j.error
    metrics = [ev.data for ev in events.since(eng, job.id, types=["metric"])]
    assert [m["step"] for m in metrics] == list(range(1, 31))
    for key in ("total_steps", "loss", "learning_rate", "grad_norm", "tokens_per_second",
                "eta_seconds", "memory_gib", "memory_kind", "epoch"):
        assert key in metrics[-1], key
    assert metrics[-1]["memory_kind"] == "rss" and metrics[-1]["total_steps"] == 30
    first = sum(m["loss"] for m in metrics[:5]) / 5
    last = sum(m["loss"] for m in metrics[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    assert j.result["steps"] == 30 and j.result["tokens"] > 0 and j.result["train_runtime"] > 0

    run_dir = Path(repo.get_run(eng, run.id).output_dir)
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["spec"]["r"] == 8 and cfg["chat_template"]["name"] == "chatml"  # the fallback
    assert cfg["chat_template"]["template"]
    kinds = {a.kind: a for a in repo.list_artifacts(eng, run.id)}
    assert set(kinds) == {"adapter", "config", "checkpoint"}
    steps = sorted(a.meta["step"] for a in repo.list_artifacts(eng, run.id, "checkpoint"))
    # recorded as the trainer saved them; save_total_limit=2 rotated checkpoint-10 away, and
    # its row went with its folder
    assert steps == [20, 30]
    ckpts = sorted(p.name for p in run_dir.glob("checkpoints/checkpoint-*")) or \
        sorted(p.name for p in run_dir.rglob("checkpoint-*") if p.is_dir())
    assert ckpts == ["checkpoint-20", "checkpoint-30"], ckpts
    logs = [ev.data["message"] for ev in events.since(eng, job.id, types=["log"])]
    done = next(m for m in logs if m.startswith("done:"))
    assert len(done.split("final loss ")[1]) <= 8, done  # rounded, not 17.136369705200195
    assert Path(kinds["adapter"].path).name == "adapter.zip" and kinds["adapter"].bytes > 0
    adapter = run_dir / "adapter"
    for f in ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json",
              "chat_template.jinja"):
        assert (adapter / f).exists(), f
    assert (run_dir / "checkpoints" / "checkpoint-30" / "optimizer.pt").exists()
    # portable: the adapter names its base as others load it; no server path in what downloads
    acfg = json.loads((adapter / "adapter_config.json").read_text())
    assert acfg["base_model_name_or_path"] == "stories260K"
    card = (adapter / "README.md").read_text()
    assert card.startswith("---\nbase_model: stories260K\n") and "karpathy/tinyllamas" in card
    assert "identity_alpaca.json" in card and "`r`: `8`" in card and "final_loss" in card
    with zipfile.ZipFile(kinds["adapter"].path) as z:
        for name in z.namelist():
            assert str(env["dir"]) not in z.read(name).decode("latin-1"), name
    assert str(env["dir"]) not in (run_dir / "config.json").read_text()

    base_dir = repo.get_model(eng, "stories260K").path
    tok = AutoTokenizer.from_pretrained(base_dir)
    prompt = "### Instruction:\nWho are you?\n\n### Response:\n"
    ids = torch.tensor([tok(prompt)["input_ids"]])
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    out_base = base.generate(ids, max_new_tokens=24, do_sample=False)
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter)
    out_tuned = tuned.generate(input_ids=ids, max_new_tokens=24, do_sample=False)
    assert not torch.equal(out_base, out_tuned)


def test_cancel_running_train_job_within_seconds(env) -> None:
    eng = env["engine"]
    _, job = _run(env, max_steps=100_000, save_steps=100_000)
    _wait(lambda: _first_metric(eng, job.id), 120, "first metric", env["proc"])
    t0 = time.monotonic()
    queue.cancel(eng, job.id)
    j = _wait(lambda: _ended(eng, job.id), 15, "cancelled", env["proc"])
    assert j.state == JobState.CANCELLED
    assert time.monotonic() - t0 < 10
    assert env["proc"].poll() is None


def test_cancelled_run_exports_its_newest_checkpoint(env) -> None:
    """Issue 19 item 10: checkpoints are recorded as the trainer saves them; a cancelled run's
    newest one exports as a PEFT adapter that loads and matches that checkpoint's weights."""
    from safetensors.torch import load_file

    from app.store.schema import Artifact  # noqa: F401
    from app.store.specs import ExportSpec

    eng = env["engine"]
    run, job = _run(env, max_steps=100_000, save_steps=2)
    _wait(lambda: len(repo.list_artifacts(eng, run.id, "checkpoint")) >= 2, 180,
          "two checkpoints", env["proc"])
    queue.cancel(eng, job.id)
    assert _wait(lambda: _ended(eng, job.id), 30, "cancelled", env["proc"]).state == "cancelled"
    arts = repo.list_artifacts(eng, run.id, "checkpoint")
    step = max(a.meta["step"] for a in arts if Path(a.path).is_dir())
    folder = Path(next(a.path for a in arts if a.meta["step"] == step))
    cfg = json.loads((folder / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == "stories260K"  # no server path
    spec = ExportSpec(run_id=run.id, format="adapter", checkpoint_step=step)
    exp = queue.enqueue(eng, "export", spec.model_dump(mode="json"), run_id=run.id, priority=5)
    j = _wait(lambda: _ended(eng, exp.id), 180, "export", env["proc"])
    assert j.state == JobState.SUCCEEDED, j.error
    assert j.result["verification"]["passed"] is True
    out = next(f["path"] for f in j.result["files"]
               if f["path"].endswith("adapter_model.safetensors"))
    got = load_file(out)
    want = load_file(str(folder / "adapter_model.safetensors"))
    assert set(got) == set(want) and all((got[k] == want[k]).all() for k in want)


def test_cancel_running_export_removes_its_files(env) -> None:
    """Cancelling an export the real worker is building (its GGUF files already on disk, more
    being quantised and verified) stops it within seconds and leaves no file and no artifact."""
    from app.store.specs import ExportSpec

    eng = env["engine"]
    run = next(r for r in repo.list_runs(eng) if repo.list_artifacts(eng, r.id, "checkpoint"))
    step = max(a.meta["step"] for a in repo.list_artifacts(eng, run.id, "checkpoint"))
    spec = ExportSpec(run_id=run.id, format="gguf", checkpoint_step=step,
                      quantization=["F16", "Q8_0", "Q4_K_M", "Q5_K_M", "Q6_K"])
    exp = queue.enqueue(eng, "export", spec.model_dump(mode="json"), run_id=run.id, priority=5)
    folder = Path(env["dir"]) / "exports" / f"export-{exp.id}"
    _wait(lambda: list(folder.glob("*.gguf")), 120, "the first GGUF file", env["proc"])
    t0 = time.monotonic()
    queue.cancel(eng, exp.id)
    j = _wait(lambda: _ended(eng, exp.id), 30, "cancelled export", env["proc"])
    assert j.state == JobState.CANCELLED and j.result is None
    assert time.monotonic() - t0 < 10
    assert not folder.exists()
    assert [a for a in repo.list_artifacts(eng, run.id) if a.job_id == exp.id] == []
    assert any(ev.data.get("message") == "cancelled by request"
               for ev in events.since(eng, exp.id, types=["log"]))
    assert env["proc"].poll() is None


def test_sigterm_requeues_running_job_and_next_worker_resumes(env) -> None:
    eng, proc = env["engine"], env["proc"]
    run, job = _run(env, max_steps=100_000, save_steps=100_000)
    _wait(lambda: _first_metric(eng, job.id), 120, "first metric", proc)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # as Ctrl-C under `make run`: the group's INT + start.sh's TERM
    assert proc.wait(30) == 0
    j = queue.get_job(eng, job.id)
    assert j.state == JobState.QUEUED and j.lease_owner is None
    assert not queue.list_jobs(eng, state=JobState.RUNNING)
    assert not workers.live(eng, 300)
    ckpts = list((env["dir"] / "runs" / run.id / "checkpoints").glob("checkpoint-*"))
    assert ckpts, "a checkpoint is saved on shutdown"
    # said in the log, not as a warning (the run page keeps warnings after the run resumed)
    said = [ev.data for ev in events.since(eng, job.id, types=["log"])
            if ev.data.get("message") == "worker shutting down; job returned to the queue"]
    assert [d.get("level") for d in said] == ["info"], said

    again = _start(env["env"], "--once", "--worker-id", "w-second")
    try:
        _wait(lambda: any("resuming from checkpoint-" in ev.data.get("message", "")
                          for ev in events.since(eng, job.id, types=["log"])), 120, "resume",
              again)
        queue.cancel(eng, job.id)
        assert again.wait(60) == 0  # --once: exits after that job
    finally:
        if again.poll() is None:
            again.kill()
    assert queue.get_job(eng, job.id).state == JobState.CANCELLED

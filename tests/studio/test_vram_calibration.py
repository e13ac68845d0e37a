"""The estimate corrects itself from measured peaks stored on job rows (real queue, SQLite and
Postgres), and a run no live GPU could hold is refused at creation.

The measured peaks are the H200 rows of bench/results.jsonl (tests/studio/test_vram_estimate.py):
one calibration run of a configuration, then the others of the same model, kind and 4-bit
setting must come within 15 % of their measured peak (stated per row, as there).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from app.settings import Settings
from app.store import queue, repo
from app.store import workers as workers_store
from app.store.db import make_engine
from app.store.migrate import upgrade
from app.store.schema import Dataset, Model
from app.studio import calibration
from app.studio.errors import StudioError
from tests.store.pgdb import throwaway_database
from tests.studio.test_vram_estimate import LLAMA_8B_INFO, spec_for

# (calibration row, [(checked row, measured GiB, error after calibration)])
CASES = [
    (("train_step", "qlora", 2048, 2, None, 6.76),
     [(("train_step", "qlora", 16384, 1, None), 8.69, -0.005),
      (("train_step", "qlora", 2048, 2, 40.0), 20.11, +0.023)]),
    (("grpo", "qlora", 256, 256, 8, 7.30),
     [(("grpo", "qlora", 256, 256, 16), 7.89, +0.003),
      (("grpo", "qlora", 1024, 1024, 8), 9.46, -0.024)]),
]


@pytest.fixture(params=["sqlite", "postgres"])
def engine(request, tmp_path: Path):
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'c.db'}"
        upgrade(url)
        eng = make_engine(url)
        yield eng
        eng.dispose()
        return
    with throwaway_database() as url:
        upgrade(url)
        eng = make_engine(url)
        yield eng
        eng.dispose()


def _setup(engine) -> tuple[Model, Dataset]:
    model = repo.add_model(engine, Model(name="llama-3.1-8b", source="hf", source_ref="x",
                                         status="ready", info=dict(LLAMA_8B_INFO)), import_job=False)
    ds = repo.add_dataset(engine, Dataset(filename="d.jsonl", path="/nonexistent", rows=1))
    return model, ds


def _measured_run(engine, model, ds, row, peak_gib: float, kind: str = "gpu") -> None:
    """A run of ``row``'s spec whose worker finished it with ``memory_peak`` in its result (as
    worker.gpu.peak() writes it), through the real queue."""
    bench = row[0]
    spec = spec_for(*row[:5]).model_copy(update={"model": model.id, "dataset": ds.id})
    _, job = repo.create_run(engine, spec, kind="grpo" if bench == "grpo" else "sft")
    claimed = queue.claim(engine, "w1", 60)
    assert claimed.id == job.id
    assert queue.finish(engine, job.id, "w1", {"memory_peak": {"kind": kind, "peak_gib": peak_gib}})


@pytest.mark.parametrize("case", CASES, ids=["sft", "grpo"])
def test_one_measured_run_calibrates_the_rest(engine, case):
    model, ds = _setup(engine)
    (calib, checks) = case
    kind = "grpo" if calib[0] == "grpo" else "train"
    before = {r: calibration.estimate(engine, model, spec_for(*r), kind) for r, _, _ in checks}
    assert calibration.correction(engine, model, kind, True) == (1.0, 0)
    _measured_run(engine, model, ds, calib, calib[5])
    job = queue.list_jobs(engine)[0]
    assert (job.peak_gib, job.peak_kind) == (calib[5], "gpu")
    factor, n = calibration.correction(engine, model, kind, True)
    raw = calibration.raw_estimate(model, spec_for(*calib[:5]), kind).allocated_gib
    assert n == 1 and factor == pytest.approx(calib[5] / raw)
    for row, measured, stated in checks:
        est = calibration.estimate(engine, model, spec_for(*row), kind)
        err = (est.allocated_gib - measured) / measured
        assert abs(err - stated) <= 0.005, f"{row}: error {err:+.3f}, stated {stated:+.3f}"
        assert abs(err) <= 0.15
        assert est.correction == factor and est.calibrated_from == 1
        assert est.allocated_gib == pytest.approx(before[row].allocated_gib * factor)
    # another key is not corrected by it: 16-bit LoRA, or the other job kind
    assert calibration.correction(engine, model, kind, False) == (1.0, 0)
    assert calibration.correction(engine, model, "grpo" if kind == "train" else "train",
                                  True) == (1.0, 0)


def test_cpu_rss_peaks_do_not_calibrate_gpu_estimates(engine):
    model, ds = _setup(engine)
    _measured_run(engine, model, ds, ("train_step", "qlora", 2048, 2, None), 0.9, kind="rss")
    job = queue.list_jobs(engine)[0]
    assert (job.peak_gib, job.peak_kind) == (0.9, "rss")
    assert calibration.correction(engine, model, "train", True) == (1.0, 0)


def test_too_big_refused_only_when_live_gpu_workers_report_capacity(engine):
    model, _ = _setup(engine)
    settings = Settings(worker_stale_seconds=30)
    # bf16 8B, 131072 tokens a batch, a 400 GiB budget: ~23 layers keep 14 GiB of activations each
    spec = spec_for("train_step", "lora", 16384, 8, 400.0)
    est = calibration.estimate(engine, model, spec, "train")
    assert est.total_gib > 141
    assert calibration.for_new_run(engine, settings, model, spec, "sft") > 141  # no worker
    workers_store.register(engine, "cpu-1", "h", 1, "cpu (2 cores)")  # CPU worker: no capacity
    assert calibration.for_new_run(engine, settings, model, spec, "sft") > 141
    workers_store.register(engine, "gpu-0", "h", 2, "cuda:0 NVIDIA H200", 139.8)
    workers_store.register(engine, "gpu-1", "h", 3, "cuda:0 NVIDIA H100", 79.2)
    with pytest.raises(StudioError) as exc:
        calibration.for_new_run(engine, settings, model, spec, "sft")
    assert exc.value.code == "too_big_for_gpus" and exc.value.kind == "invalid"
    assert f"about {est.total_gib:.1f} GiB" in exc.value.message
    assert "largest GPU of the live workers has 139.8 GiB" in exc.value.message
    small = spec_for("train_step", "qlora", 2048, 2, None)
    assert calibration.for_new_run(engine, settings, model, small, "sft") == pytest.approx(
        calibration.estimate(engine, model, small, "train").allocated_gib, abs=1e-4)


def test_a_run_over_its_owners_gpu_memory_quota_is_refused_counting_every_gpu() -> None:
    """The quota rule admission applies (need on all its GPUs > quota: never admitted) refuses
    the run at creation; a need within the quota, no quota or no estimate passes."""
    from app.store.admission import Owner, over_gib_quota, quota_reason
    from app.store.schema import User
    from app.studio.estimate import Estimate

    settings = Settings(gpu_admit_margin=0.25)
    est = Estimate(weights_gib=3.0, allocated_gib=4.0, context_gib=0.5, total_gib=4.5)
    bea = User(name="bea", password_hash="x", quota_gib=10.0)  # need 4 x 1.25 + 0.5 = 5.5
    calibration.check_quota(settings, bea, est)
    with pytest.raises(StudioError) as exc:  # 2 GPUs: 11 GiB at once
        calibration.check_quota(settings, bea, est, num_gpus=2)
    assert (exc.value.kind, exc.value.code, exc.value.field) == (
        "invalid", "over_gpu_memory_quota", None)
    assert exc.value.message.startswith("this run needs about 11 GiB of GPU memory at once "
                                        "(5.5 GiB on each of 2 GPUs)")
    assert "more than your GPU memory quota of 10 GiB at once" in exc.value.message
    for owner, e in ((User(name="al", password_hash="x"), est), (bea, None), (None, est)):
        calibration.check_quota(settings, owner, e, num_gpus=2)
    # the same rule in the queue's reason (before the quota on the owner's other jobs)
    assert over_gib_quota(10.0, 11.0) and not over_gib_quota(10.0, 10.0)
    busy = Owner("u", "bea", quota_gib=10.0, running=1, held_gib=6.0)
    assert quota_reason(busy, 5.5).startswith("over quota: your 1 running job holds 6.0 GiB")
    assert quota_reason(busy, 11.0).startswith(
        "over quota, can never start under your current quota: this job needs 11 GiB")

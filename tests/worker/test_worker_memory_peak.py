"""The real worker process on the CPU records a job's measured memory peak: the sampled process
RSS in ``result.memory_peak``, on the job row (``peak_gib``, ``peak_kind='rss'``) and as the
``peak_gib`` field of its metric events; the imported model's info carries the shape the
estimate reads; a CPU worker registers no GPU capacity."""
from __future__ import annotations

import pytest

from app.store import events, queue, repo, workers
from app.store.specs import TrainSpec
from app.studio import calibration
from tests.worker.test_worker_process import SMALL, _ended, _wait, env  # noqa: F401 - fixture

pytestmark = pytest.mark.slow


def test_cpu_training_job_records_its_rss_peak(env) -> None:  # noqa: F811
    engine = env["engine"]
    def ready():
        try:
            m = repo.get_model(engine, "stories260K")
        except repo.NotFound:  # the worker registers it at start
            return None
        return m if m.status == "ready" else None

    model = _wait(ready, 120, "the demo model import", env["proc"])
    info = model.info
    assert (info["layers"], info["hidden_size"], info["intermediate_size"]) == (5, 64, 172)
    assert (info["num_attention_heads"], info["num_key_value_heads"], info["vocab"]) == (8, 4, 512)
    w = workers.live(engine, 60)
    assert w and all(x.gpu_total_gib is None for x in w)  # CPU worker: no capacity, no refusal

    spec = TrainSpec(model=model.id, dataset=env["dataset"], max_steps=4, **SMALL)
    est = calibration.estimate(engine, model, spec, "train")
    # 260K parameters: the GEMM workspaces (1/16 GiB, measured on an H200) are nearly all of it
    assert est.weights_gib < 0.001 and est.workspace_gib == pytest.approx(1 / 16)
    assert 1 / 16 < est.allocated_gib < 0.07
    _, job = repo.create_run(engine, spec, estimate_gib=est.allocated_gib)
    done = _wait(lambda: _ended(engine, job.id), 300, "the training job", env["proc"])
    assert done.state == "succeeded", done.error
    peak = done.result["memory_peak"]
    assert peak["kind"] == "rss" and 0.1 < peak["peak_gib"] < 8  # a Python + torch process
    assert (done.peak_gib, done.peak_kind) == (peak["peak_gib"], "rss")
    assert done.estimate_gib == pytest.approx(est.allocated_gib)
    metrics = [e.data for e in events.since(engine, job.id, 0) if e.type == "metric"]
    assert len(metrics) == 4
    peaks = [m["peak_gib"] for m in metrics]
    assert peaks == sorted(peaks) and peaks[-1] <= peak["peak_gib"]
    # an RSS says nothing about a GPU: it does not calibrate the GPU estimate
    assert calibration.correction(engine, model, "train", False) == (1.0, 0)
    memory = calibration.memory_summary(queue.get_job(engine, job.id))
    assert memory["peak_kind"] == "rss" and memory["error"] is None

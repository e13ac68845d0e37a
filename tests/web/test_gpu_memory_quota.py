"""A GPU memory quota ("GPU memory at once") below what a run needs (trial: a 0.1 GiB quota, a
run needing 0.6 GiB waited forever): every surface refuses to create such a run, naming the need
and the quota; a job already queued when an admin lowers the quota below its need says it can
never start under it (not that it waits for its owner's other jobs)."""
from __future__ import annotations

from app.store import queue, workers
from app.store.admission import Slot
from tests.web.conftest import signed_in
from tests.web.test_vram_web import FORM, _llama
from tests.web.test_web_runs import _upload

CPU_SLOT = Slot("vm-slot", "vm", None, None, None)
#: FORM's run on the 8B model: 6.73 GiB allocator peak x 1.25 margin + 0.5 GiB CUDA context
NEED = "8.92 GiB"


def _quota(client, user_id: str, gib: str) -> None:
    r = client.post(f"/admin/quotas/{user_id}", data={"quota_jobs": "", "quota_gib": gib,
                                                      "quota_gpu_hours": "", "share_weight": "1"},
                    headers={"HX-Request": "true"})
    assert r.status_code == 200, r.text


def test_a_run_over_the_gpu_memory_quota_is_refused_and_a_queued_one_says_never(
        app, client, engine) -> None:
    model = _llama(engine)
    r = client.post("/api/users", json={"name": "bea", "password": "member-password-1"})
    bea = r.json()["id"]
    _quota(client, bea, "1")
    body = {"model": model.id, "load_in_4bit": True, "max_seq_length": 2048,
            "per_device_train_batch_size": 2}
    quota = "more than your GPU memory quota of 1 GiB at once: it could never start"
    with signed_in(app, "bea", "member-password-1") as c:
        ds = _upload(c)
        r = c.post("/api/runs", json={**body, "dataset": ds})
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["code"] == "over_gpu_memory_quota" and err["param"] is None
        assert err["message"].startswith(f"this run needs about {NEED} of GPU memory at once")
        assert quota in err["message"] and "ask an admin to raise your quota" in err["message"]
        page = c.post("/runs", data={**FORM, "model": model.id, "dataset": ds},
                      headers={"HX-Request": "true"})
        assert page.status_code == 422 and quota in page.text  # above the form, not a 500
        assert 'name="max_seq_length"' in page.text
        v1 = c.post("/v1/fine_tuning/jobs", json={"model": model.id, "training_file": ds})
        assert v1.status_code == 400, v1.text
        assert v1.json()["error"]["code"] == "over_gpu_memory_quota"
        assert "more than your GPU memory quota of 1 GiB" in v1.json()["error"]["message"]
        assert c.get("/api/runs").json()["data"] == []
    # within the quota it is created; a small job of bea's runs on the CPU slot
    _quota(client, bea, "20")
    small = queue.enqueue(engine, "train", {}, owner=bea, estimate_gib=0.1)
    with signed_in(app, "bea", "member-password-1") as c:
        r = c.post("/api/runs", json={**body, "dataset": ds})
        assert r.status_code == 201, r.text
        job_id = c.get(f"/api/runs/{r.json()['id']}").json()["job_id"]
        workers.register(engine, CPU_SLOT.id, "vm", 1, "cpu slot (2 cores, one job at a time)")
        assert queue.admit(engine, CPU_SLOT, 300, ["train"], 0.25, 24.0).id == small.id
        (row,) = c.get("/api/queue").json()["waiting"]
        assert (row["job_id"], row["reason"]) == (
            job_id, "behind 1 job: the CPU slot (no GPU) runs one job at a time")
        # an admin lowers the quota below the run's need: it can never start, even alone
        _quota(client, bea, "2")
        (row,) = c.get("/api/queue").json()["waiting"]
        assert row["reason"] == (
            f"over quota, can never start under your current quota: this job needs {NEED} of "
            "GPU memory at once, more than your limit of 2 GiB even with no other job running; "
            "an admin can raise the limit (GPU memory at once) on the Admin page")
        assert "can never start under your current quota" in c.get("/queue").text
    (row,) = client.get("/api/queue").json()["waiting"]
    assert row["reason"].startswith("over quota, can never start under bea's current quota: ")
    assert "more than bea's limit of 2 GiB" in row["reason"]
    # a need within the quota that waits for the owner's other jobs keeps its reason
    _quota(client, bea, "9")
    (row,) = client.get("/api/queue").json()["waiting"]
    assert row["reason"] == ("over quota: bea's 1 running job holds 0.6 GiB of bea's 9 GiB; "
                             "this one needs 8.9 GiB")

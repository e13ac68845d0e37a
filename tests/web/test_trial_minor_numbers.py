"""Trial findings on numbers and isolation wording (trial-break F4, F8, F9, F12, F13), each
driven over HTTP against the app:

- F4: a /v1 ``learning_rate_multiplier`` whose learning rate is below the smallest
  ``learning_rate`` (1e-300 trained with lr 2e-304 and read back 0.0) is a 400 naming it; the
  form and /api refuse such a ``learning_rate`` too, and a small valid one reads back as given.
- F8: "Jobs at once" 1.5 is "must be a whole number", named by its column; 2.0 and 1e3 are whole.
- F9: a GPU memory quota of 0.001 GiB is quoted as 0.001, not "0 GiB".
- F12: another user's run named in both compare slots is a 404, not "choose two different runs".
- F13: the compare page labels the training time as a duration, and a cancelled run shows the
  steps and losses of its loss curve.
"""
from __future__ import annotations

import html
import re

import pytest

from app.store import events, queue, repo
from app.studio import accounts
from tests.web.conftest import ADMIN_PASSWORD, ADMIN_USER, signed_in, upload_sft
from tests.web.test_gpu_memory_quota import _quota
from tests.web.test_openai_lr_multiplier import _job
from tests.web.test_openai_lr_multiplier import file_id  # noqa: F401  (fixture)
from tests.web.test_vram_web import _llama
from tests.web.test_web_runs import _upload


@pytest.mark.parametrize("reinforcement", [False, True])
def test_a_multiplier_below_the_smallest_learning_rate_is_a_400(
        client, engine, file_id, reinforcement):  # noqa: F811
    base = "5e-06" if reinforcement else "0.0002"
    least = "0.002" if reinforcement else "5e-05"
    for m in (1e-300, 1e-6):
        r = _job(client, file_id, m, reinforcement)
        assert r.status_code == 400, (m, r.text)
        err = r.json()["error"]
        assert err["param"] == "hyperparameters.learning_rate_multiplier", err
        assert err["message"] == (f"learning_rate_multiplier {m:g} × the default learning rate "
                                  f"{base} = {m * float(base):g} is below the smallest "
                                  f"learning_rate, 1e-08: use at least {least}"), err
    # the smallest multiplier is taken, and a small one reads back as given (not rounded off)
    m = 0.00123456789 if not reinforcement else 0.0123456789
    r = _job(client, file_id, m, reinforcement)
    assert r.status_code == 200, r.text
    assert r.json()["hyperparameters"]["learning_rate_multiplier"] == m
    spec = repo.get_run(engine, r.json()["id"]).spec
    assert spec["learning_rate"] == pytest.approx(m * float(base), rel=1e-12)


def test_the_form_and_api_refuse_a_learning_rate_below_the_smallest(client):
    ds = upload_sft(client)
    r = client.post("/api/runs", json={"model": "stories260K", "dataset": ds,
                                       "learning_rate": 2e-304})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == "learning_rate", err
    assert err["fields"] == {"learning_rate": "must be from 1e-08 to 1, not 2e-304"}
    r = client.post("/api/runs", json={"model": "stories260K", "dataset": ds,
                                       "learning_rate": 1e-8, "max_steps": 1})
    assert r.status_code == 201, r.text


def _quota_row(client, user_id: str, jobs: str):
    return client.post(f"/admin/quotas/{user_id}", headers={"HX-Request": "true"},
                       data={"quota_jobs": jobs, "quota_gib": "", "quota_gpu_hours": "",
                             "share_weight": "1"})


def test_jobs_at_once_must_be_whole_and_whole_decimals_are_taken(client, engine):
    bea = client.post("/api/users", json={"name": "bea", "password": "member-password-1"})
    bea = bea.json()["id"]
    for bad in ("1.5", "abc", "nan"):
        r = _quota_row(client, bea, bad)
        assert r.status_code == 422, (bad, r.text)
        (msg,) = re.findall(r'<span class="field-error"[^>]*>([^<]*)</span>', r.text)
        assert msg == ("Jobs at once must be a whole number, 0 or more (empty: no limit), "
                       f"not {bad}"), msg
        assert accounts.get_user(engine, bea).quota_jobs is None
    for text, value in (("2.0", 2), ("1e3", 1000), (" 3 ", 3)):
        r = _quota_row(client, bea, text)
        assert r.status_code == 200, (text, r.text)
        assert accounts.get_user(engine, bea).quota_jobs == value
    r = _quota_row(client, bea, "-1.0")
    assert r.status_code == 422 and "Jobs at once must be at least 0" in r.text


def test_a_small_gpu_memory_quota_is_quoted_as_set(app, client, engine):
    model = _llama(engine)
    bea = client.post("/api/users", json={"name": "bea", "password": "member-password-1"})
    bea = bea.json()["id"]
    body = {"model": model.id, "load_in_4bit": True, "max_seq_length": 2048}
    _quota(client, bea, "20")
    with signed_in(app, "bea", "member-password-1") as c:
        ds = _upload(c)
        assert c.post("/api/runs", json={**body, "dataset": ds}).status_code == 201  # queued
        _quota(client, bea, "0.001")
        r = c.post("/api/runs", json={**body, "dataset": ds})
        assert r.status_code == 422, r.text
        msg = r.json()["error"]["message"]
        assert "more than your GPU memory quota of 0.001 GiB at once" in msg, msg
        (row,) = c.get("/api/queue").json()["waiting"]
        assert "more than your limit of 0.001 GiB even with no other job running" in row["reason"]


def _trained(client, engine, ds, worker, steps, *, cancel=False, runtime=423.7):
    r = client.post("/api/runs", json={"model": "stories260K", "dataset": ds, "max_steps": 20})
    assert r.status_code == 201, r.text
    run = repo.get_run(engine, r.json()["id"])
    assert queue.claim(engine, worker, 30, kinds=["train"]).id == run.job_id
    events.append_many(engine, run.job_id, [
        ("metric", {"step": s, "total_steps": 20, "loss": 22.0 - s * 0.25})
        for s in range(1, steps + 1)] + [
        ("log", {"message": "segment", "segment": {"job_id": run.job_id, "from_step": 0,
                                                   "to_step": steps, "train_runtime": runtime}})])
    if cancel:
        queue.cancel(engine, run.job_id)  # the worker acknowledges, as a cancelled run's does
        assert queue.acknowledge_cancel(engine, run.job_id, worker)
    else:
        assert queue.finish(engine, run.job_id, worker, {
            "steps": steps, "first_loss": 21.75, "final_loss": 17.0, "train_loss": 19.4,
            "train_runtime": runtime})
    return run.id


def test_compare_labels_the_training_time_and_shows_a_cancelled_runs_curve(client, engine):
    ds = upload_sft(client)
    a = _trained(client, engine, ds, "w-a", 20)
    b = _trained(client, engine, ds, "w-b", 13, cancel=True, runtime=61.2)
    page = client.get("/runs/compare", params={"a": a, "b": b})
    assert page.status_code == 200, page.text

    def figures(key):
        side = page.text[page.text.index(f'id="side-{key}"'):]
        side = side[:side.index("</div>")]
        return re.findall(r'data-result="\w+">([^<]*) <strong>([^<]*)</strong>', side)

    assert figures("a") == [("steps", "20"), ("first loss", "21.75"), ("final loss", "17"),
                            ("mean train loss", "19.4"), ("training time", "7 min 03 s")]
    assert figures("b") == [("steps", "13"), ("first loss", "21.75"), ("final loss", "18.75"),
                            ("training time", "1 min 01 s")]
    cmp = client.get(f"/api/runs/{a}/compare", params={"other": b}).json()
    assert cmp["b"]["result"] == {"steps": 13, "first_loss": 21.75, "final_loss": 18.75,
                                  "train_runtime": 61.2}  # seconds, as the trainer names it


def test_another_users_run_in_both_compare_slots_is_a_404(app, client, engine):
    ds = upload_sft(client)
    mine = _trained(client, engine, ds, "w-a", 3)
    admin = accounts.authenticate(engine, ADMIN_USER, ADMIN_PASSWORD)
    accounts.create_user(engine, "bea", "bea-password-1", actor=admin)
    with signed_in(app, "bea", "bea-password-1") as bea:
        r = bea.get("/runs/compare", params={"a": mine, "b": mine})
        assert r.status_code == 404, r.text
        assert "choose two different runs" not in r.text
        r = bea.get(f"/api/runs/{mine}/compare", params={"other": mine})
        assert r.status_code == 404, r.text
    r = client.get("/runs/compare", params={"a": mine, "b": mine})  # the owner: the same run
    assert r.status_code == 422 and "choose two different runs" in r.text


def test_true_and_false_are_not_numbers(client, engine):
    """Trial s21 F6: ``"per_device_train_batch_size": true`` made a run with batch 1 (pydantic's
    lax mode reads booleans as 1/0); every number field of a spec refuses them, naming the
    field; a boolean field still takes them."""
    ds = upload_sft(client)
    r = client.post("/api/runs", json={"model": "stories260K", "dataset": ds, "max_steps": 1,
                                       "per_device_train_batch_size": True, "lora_dropout": False})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["fields"] == {"per_device_train_batch_size": "must be a number, not true",
                                           "lora_dropout": "must be a number, not false"}
    r = client.post("/api/runs", json={"model": "stories260K", "dataset": ds, "max_steps": 1,
                                       "packing": True})
    assert r.status_code == 201, r.text
    assert repo.get_run(engine, r.json()["id"]).spec["packing"] is True


def test_a_number_of_5000_digits_is_named_as_such_not_invalid_json(client):
    """Trial s21 F7: a body with a 5000-digit integer is valid JSON that Python will not convert;
    /api and /v1 say that, not "not valid JSON" (which a truncated body still gets)."""
    big = '{"model": "stories260K", "dataset": "x", "r": ' + "9" * 5000 + "}"
    for url in ("/api/runs", "/v1/fine_tuning/jobs"):
        r = client.post(url, content=big, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert "a number of more than 4300 digits" in r.text, r.text
        r = client.post(url, content=big[:60], headers={"content-type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.text, r.text


def test_a_seed_past_32_bits_is_refused_when_the_run_is_created(client, engine, file_id):  # noqa: F811
    """Trial s23 M-1: seed 2**32 was taken by the form and /api, then the job failed in the
    worker with numpy's "Seed must be between 0 and 2**32 - 1" after its turn in the queue. Now
    every surface refuses it naming the field; 2**32 - 1 is still a seed."""
    ds = upload_sft(client)
    said = "must be from 0 to 4,294,967,295, not 4,294,967,296"
    r = client.post("/api/runs", json={"model": "stories260K", "dataset": ds, "max_steps": 2,
                                       "seed": 2**32})
    assert r.status_code == 422 and r.json()["error"]["fields"] == {"seed": said}, r.text
    r = client.post("/v1/fine_tuning/jobs", json={"model": "stories260K", "training_file": file_id,
                                                  "seed": 2**32})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    form = {"model": "stories260K", "dataset": ds, "max_steps": "2", "seed": str(2**32),
            "target_modules": ["q_proj", "v_proj"]}
    r = client.post("/runs", data=form, follow_redirects=False)
    assert r.status_code == 422, r.text
    assert "must be from 0 to 4,294,967,295, not '4294967296'" in html.unescape(r.text)
    assert repo.list_runs(engine) == []
    r = client.post("/api/runs", json={"model": "stories260K", "dataset": ds, "max_steps": 2,
                                       "seed": 2**32 - 1})
    assert r.status_code == 201 and r.json()["spec"]["seed"] == 2**32 - 1, r.text

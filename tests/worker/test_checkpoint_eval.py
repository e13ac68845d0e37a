"""The GRPO before/after reward eval and on-demand checkpoint evals, end to end on the CPU: real
uploads over HTTP, GRPO (GSM8K rows, the worked example's numeric_match reward) and SFT runs
created through /api with a held-out split, the real ``grpo``, ``train`` and ``evaluate`` job
functions on stories260K (in-process worker loop), then what /api and the run page show.

The stored numbers are checked against the things they claim to be: each reward recomputed by
the real reward function from the stored completion, the completions against greedy decoding of
the checkpoint loaded independently with transformers + PEFT, the final step's checkpoint eval
against the end-of-run table (the same weights).
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from app.settings import Settings
from app.store import queue, repo
from app.store.db import reset_engines
from app.store.schema import JobState
from tests.conftest import SHARED_DATA, STORIES
from tests.web.conftest import ADMIN_PASSWORD, ADMIN_USER, run_validations, signed_in

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (STORIES / "stories260K.bin").exists(),
                                 reason=f"no test data at {SHARED_DATA}")]

GSM8K = SHARED_DATA / "grpo" / "gsm8k" / "test.jsonl"
IDENTITY = SHARED_DATA / "sft" / "identity_alpaca.json"
GRPO = {"model": "stories260K", "validation_split_percentage": 10, "reward_eval_samples": 3,
        "max_steps": 2, "save_steps": 1, "num_generations": 2, "per_device_train_batch_size": 4,
        "max_completion_length": 8, "max_prompt_length": 48, "learning_rate": 2e-2, "r": 8,
        "lora_alpha": 16, "seed": 1, "beta": 0.0,
        "rewards": [{"name": "numeric_match"}, {"name": "text_similarity", "weight": 0.5}]}
SFT = {"model": "stories260K", "validation_split_percentage": 10, "generation_eval_samples": 2,
       "max_steps": 2, "save_steps": 1, "per_device_train_batch_size": 4,
       "gradient_accumulation_steps": 1, "max_seq_length": 256, "learning_rate": 1e-2, "r": 8,
       "lora_alpha": 16, "warmup_ratio": 0.0, "chat_template": "chatml"}


@pytest.fixture(scope="module")
def studio(tmp_path_factory):
    from app.web.main import create_app
    from worker.loop import Worker

    d = tmp_path_factory.mktemp("ckeval")
    settings = Settings(data_dir=d / "data", seed_dir=SHARED_DATA, max_upload_mb=8,
                        admin_user=ADMIN_USER, admin_password=ADMIN_PASSWORD,
                        heartbeat_seconds=0.5)
    gsm = d / "gsm8k40.jsonl"
    gsm.write_text("".join(GSM8K.read_text().splitlines(keepends=True)[:40]))
    app = create_app(settings)
    with signed_in(app) as client:
        w = Worker(settings, worker_id="w-ckeval", poll_interval=0.05)
        w.start()
        ids = {}
        for path in (gsm, IDENTITY):
            with path.open("rb") as fh:
                r = client.post("/v1/files", files={"file": (path.name, fh)},
                                data={"purpose": "fine-tune"})
            assert r.status_code == 200, r.text
            ids[path.name] = r.json()["id"]
        r = client.post("/api/users", json={"name": "bob", "password": "bob-password-1",
                                            "role": "member"})
        assert r.status_code == 201, r.text
        run_validations(app)
        for _ in range(5):  # the demo model's import
            if repo.get_model(w.engine, "stories260K").status == "ready":
                break
            w.serve(once=True)
        with signed_in(app, "bob", "bob-password-1") as bob:
            yield {"client": client, "bob": bob, "worker": w, "engine": w.engine, "ids": ids,
                   "gsm": gsm, "app": app}
        w.stop()
    reset_engines()


def _serve(studio, job_id: int):
    studio["worker"].serve(once=True)
    job = queue.get_job(studio["engine"], job_id)
    assert job.state == JobState.SUCCEEDED, job.error
    return job


def _train(studio, path: str, spec: dict):
    r = studio["client"].post(path, json=spec)
    assert r.status_code == 201, r.text
    run = repo.get_run(studio["engine"], r.json()["id"])
    return run, _serve(studio, run.job_id)


def _evaluate(studio, run_id: str, step: int, **body):
    r = studio["client"].post(f"/api/runs/{run_id}/checkpoints/{step}/evaluations", json=body)
    assert r.status_code == 202, r.text
    assert r.json()["status"] == "queued" and r.json()["checkpoint_step"] == step
    _serve(studio, r.json()["id"])
    r = studio["client"].get(f"/api/evaluations/{r.json()['id']}")
    assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
    return r.json()


def _held_prompts(studio, run):
    """The held-out prompts rebuilt here: the file, the split (same seed rule as SFT)."""
    from app.data.encode import load_tokenizer_bundle
    from worker.engine.evaluation import split_held_out
    from worker.engine.grpo import build_prompts

    model = repo.get_model(studio["engine"], run.model_id)
    prompts = build_prompts(str(studio["gsm"]), load_tokenizer_bundle(model.path),
                            run.spec["chat_template"], None, None, None)
    held = split_held_out(prompts.rows, 10, run.spec["seed"])[1]
    return [prompts.dataset[i]["prompt"] for i in held], [i + 1 for i in held]


def _check_rewards(table, rows_by_number, weights):
    """Every stored reward is the real reward function's value on the stored completion."""
    from worker.rewards.base import Sample
    from worker.rewards.builtin import make_builtin

    fns = {name: make_builtin(name, {}, "answer") for name in weights}
    for row in table["rows"]:
        item = rows_by_number[row["row"]]
        for side in ("base", "fine_tuned"):
            s = Sample(0, "", row[side], row[f"{side}_tokens"], item)
            got = {name: f.fn(s) for name, f in fns.items()}
            assert row[f"{side}_rewards"] == pytest.approx(got, abs=1e-12), (row, side)
            assert row[f"{side}_reward"] == pytest.approx(
                sum(weights[n] * v for n, v in got.items()), abs=1e-6)
    s = table["summary"]
    for side in ("base", "fine_tuned"):
        for f in s["functions"]:
            vals = [r[f"{side}_rewards"][f["name"]] for r in table["rows"]]
            assert f[side] == pytest.approx(sum(vals) / len(vals), abs=1e-4)
        assert s[f"{side}_reward"] == pytest.approx(
            sum(r[f"{side}_reward"] for r in table["rows"]) / len(table["rows"]), abs=1e-4)
        correct = [r[f"{side}_rewards"]["numeric_match"] == 1.0 for r in table["rows"]]
        acc = next(a for a in s["accuracy"] if a["function"] == "numeric_match")
        assert acc[side] == pytest.approx(sum(correct) / len(correct), abs=1e-4)
    assert [a["function"] for a in s["accuracy"]] == ["numeric_match"]


def _greedy(model_dir: str, adapter, prompts: list[str], max_prompt: int, new: int) -> list[str]:
    """Greedy completions of the base (+ adapter) loaded here with transformers + PEFT."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    out = []
    for p in prompts:
        ids = tok(text=p, add_special_tokens=False)["input_ids"][-max_prompt:]
        x = torch.tensor([ids])
        with torch.no_grad():
            y = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=new, pad_token_id=tok.eos_token_id)[0, len(ids):]
        y = y.tolist()
        if tok.eos_token_id in y:
            y = y[:y.index(tok.eos_token_id) + 1]
        out.append(tok.decode(y, skip_special_tokens=True))
    return out


def test_grpo_reward_eval_and_checkpoint_evals(studio) -> None:
    from app.studio import checkpoint_eval
    from app.store.queue import CPU_KINDS
    from worker.engine.grpo import clip_start
    from worker.loop import HANDLERS

    c, engine = studio["client"], studio["engine"]
    run, job = _train(studio, "/api/runs/grpo", {**GRPO, "dataset": studio["ids"]["gsm8k40.jsonl"]})
    ev, table = job.result["eval"], job.result["reward_eval"]
    # the held-out prompts: 10% of 40 chosen by the seeded shuffle, shown with their rows
    prompts, numbers = _held_prompts(studio, run)
    assert ev["source"] == "validation_split_percentage" and ev["seed"] == 1
    assert ev["rows"] == 4 and ev["training_rows"] == 36 and ev["row_numbers"] == numbers
    assert table["summary"]["samples"] == 3
    assert [r["row"] for r in table["rows"]] == numbers[:3]
    assert [r["prompt"] for r in table["rows"]] == [clip_start(p, 600) for p in prompts[:3]]
    rows = {i + 1: json.loads(line) for i, line in enumerate(studio["gsm"].read_text().splitlines())}
    assert [r["reference"] for r in table["rows"]] == [rows[n]["answer"] for n in numbers[:3]]
    _check_rewards(table, rows, {"numeric_match": 1.0, "text_similarity": 0.5})
    # before = the base model; after = the trained adapter: both are greedy decoding
    model_dir = repo.get_model(engine, run.model_id).path
    run_dir = studio["worker"].settings.data_dir / "runs" / run.id
    assert [r["base"] for r in table["rows"]] == _greedy(model_dir, None, prompts[:3], 48, 8)
    assert [r["fine_tuned"] for r in table["rows"]] == _greedy(model_dir, run_dir / "adapter",
                                                               prompts[:3], 48, 8)
    assert any(r["base"] != r["fine_tuned"] for r in table["rows"])  # training changed them
    stored = json.loads((run_dir / "eval.json").read_text())
    assert stored["reward_eval"] == table

    # on demand: checkpoint-1 is what greedy decoding of checkpoint-1 gives; checkpoint-2 is
    # the final weights, so its table is the end-of-run one
    assert checkpoint_eval.checkpoint_steps(engine, run.id) == [2, 1]
    one = _evaluate(studio, run.id, 1)
    t1 = one["reward_eval"]
    assert [r["fine_tuned"] for r in t1["rows"]] == _greedy(
        model_dir, run_dir / "checkpoints" / "checkpoint-1", prompts[:3], 48, 8)
    assert [r["base"] for r in t1["rows"]] == [r["base"] for r in table["rows"]]
    _check_rewards(t1, rows, {"numeric_match": 1.0, "text_similarity": 0.5})
    two = _evaluate(studio, run.id, 2, samples=3)
    assert two["reward_eval"] == table
    assert one["held_out"]["row_numbers"] == numbers
    # the eval is a GPU-lane job admitted by its estimated memory
    evjob = queue.get_job(engine, one["id"])
    assert evjob.kind == "evaluate" and "evaluate" in HANDLERS and "evaluate" not in CPU_KINDS
    assert evjob.run_id == run.id and 0 < evjob.estimate_gib < 0.5
    arts = [a for a in repo.list_artifacts(engine, run.id, "checkpoint_eval")]
    assert sorted(a.meta["step"] for a in arts) == [1, 2]
    assert json.loads(open(arts[0].path).read())["reward_eval"] in (t1, table)

    # /api lists everything; the run page shows the tables and a button per checkpoint
    r = c.get(f"/api/runs/{run.id}/evaluations")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["held_out"] == "10% of the dataset, shuffled with seed 1"
    assert body["end_of_run"]["reward_eval"] == table
    assert [e["checkpoint_step"] for e in body["evals"]] == [2, 1]
    assert [ck["step"] for ck in body["checkpoints"]] == [2, 1] and not body["active"]
    page = c.get(f"/runs/{run.id}").text
    assert 'id="reward-eval"' in page and 'id="evaluate-1"' in page and 'id="evaluate-2"' in page
    assert f'id="checkpoint-eval-table-{one["id"]}"' in page
    assert "10% of the dataset, shuffled with seed 1" in page and "Eval loss every" not in page
    assert "Accuracy (<code class=\"small\">numeric_match</code>)" in page
    studio["grpo_run"] = run.id


def test_refusals_and_ownership(studio) -> None:
    c, bob, engine = studio["client"], studio["bob"], studio["engine"]
    if "grpo_run" not in studio:
        pytest.skip("needs the GRPO run")
    run_id = studio["grpo_run"]
    r = c.post(f"/api/runs/{run_id}/checkpoints/3/evaluations", json={})
    assert r.status_code == 404
    msg = r.json()["error"]["message"]
    assert msg.startswith(f"run {run_id} has no checkpoint at step 3 on disk: the run "), msg
    assert msg.endswith("(checkpoints on disk: 2, 1)") and "save_total_limit" not in msg
    r = c.post(f"/api/runs/{run_id}/checkpoints/2/evaluations", json={"samples": 0})
    assert r.status_code == 422 and "from 1 to 100" in r.text
    queued = c.post(f"/api/runs/{run_id}/checkpoints/2/evaluations")  # no body: the default
    assert queued.status_code == 202 and queued.json()["samples"] == 3
    r = c.post(f"/api/runs/{run_id}/checkpoints/2/evaluations", json={})
    assert r.status_code == 409
    assert r.json()["error"]["message"] == (
        f"checkpoint-{2} of run {run_id} is already being evaluated (evaluation "
        f"{queued.json()['id']}, queued); cancel that evaluation to evaluate it again")
    # the page says it is queued instead of a button, and keeps polling while it is queued
    page = c.get(f"/runs/{run_id}").text
    assert 'id="evaluate-2"' not in page and "is already being evaluated" not in page
    assert (f'id="evaluating-2" role="status">Evaluation {queued.json()["id"]} queued — '
            "results appear below when it finishes") in page
    assert 'hx-trigger="every 3s"' in page
    r = c.post(f"/runs/{run_id}/checkpoints/2/evaluate", headers={"HX-Request": "true",
                                                                   "HX-Target": "evaluation"})
    # a second click is refused above the list, once (tests/web/test_evaluate_click.py)
    assert r.status_code == 409 and 'id="eval-error"' in r.text
    assert r.text.count("is already being evaluated") == 1
    # another user: every eval route answers 404, as for a run that does not exist
    for method, url in (("get", f"/api/runs/{run_id}/evaluations"),
                        ("post", f"/api/runs/{run_id}/checkpoints/2/evaluations"),
                        ("get", f"/api/evaluations/{queued.json()['id']}")):
        r = getattr(bob, method)(url)
        assert r.status_code == 404, (url, r.text)
    r = bob.post(f"/runs/{run_id}/checkpoints/2/evaluate")
    assert r.status_code == 404
    # cancelling: the page shows a Cancel button beside the queued eval (asking first); another
    # user's cancel is a 404 on both surfaces; the owner's ends it at once; a second is a 409
    eval_id = queued.json()["id"]
    assert f'id="cancel-eval-{eval_id}"' in page and f'hx-post="/evaluations/{eval_id}/cancel"' \
        in page and "hx-confirm=\"Cancel the evaluation of checkpoint-2?" in page
    assert bob.post(f"/api/evaluations/{eval_id}/cancel").status_code == 404
    assert bob.post(f"/evaluations/{eval_id}/cancel").status_code == 404
    assert queue.get_job(engine, eval_id).state == JobState.QUEUED
    r = c.post(f"/evaluations/{eval_id}/cancel", headers={"HX-Request": "true"})
    assert r.status_code == 200 and 'id="evaluation"' in r.text and "<html" not in r.text
    assert f'id="cancel-eval-{eval_id}"' not in r.text and 'id="evaluate-2"' in r.text
    assert c.get(f"/api/evaluations/{eval_id}").json()["status"] == "cancelled"
    r = c.post(f"/api/evaluations/{eval_id}/cancel")
    assert r.status_code == 409 and r.json()["error"]["message"] == (
        f"evaluation {eval_id} is already cancelled; only a queued or running job can be "
        "cancelled")
    r = c.post(f"/evaluations/{eval_id}/cancel", headers={"HX-Request": "true"})
    assert r.status_code == 409 and "is already cancelled" in r.text


def test_sft_checkpoint_eval_and_no_held_out(studio) -> None:
    c, engine = studio["client"], studio["engine"]
    run, job = _train(studio, "/api/runs", {**SFT, "dataset": studio["ids"]["identity_alpaca.json"]})
    gen = job.result["generation_eval"]
    assert gen["summary"]["samples"] == 2
    # checkpoint-2 holds the final weights: its on-demand table is the end-of-run one
    two = _evaluate(studio, run.id, 2)
    assert two["generation_eval"] == gen and two["samples"] == 2
    assert two["held_out"]["row_numbers"] == job.result["eval"]["row_numbers"]
    page = c.get(f"/runs/{run.id}").text
    assert f'id="checkpoint-eval-table-{two["id"]}"' in page and 'id="evaluate-1"' in page
    # a run without a held-out set has nothing to evaluate on (refused before anything else)
    spec = {k: v for k, v in SFT.items() if k not in ("validation_split_percentage",
                                                       "generation_eval_samples")}
    r = c.post("/api/runs", json={**spec, "dataset": studio["ids"]["identity_alpaca.json"]})
    assert r.status_code == 201, r.text
    bare = r.json()["id"]
    r = c.post(f"/api/runs/{bare}/checkpoints/2/evaluations", json={})
    assert r.status_code == 409
    assert r.json()["error"]["message"] == (f"run {bare} has no held-out set to evaluate on: it "
                                            "was created without validation_file or "
                                            "validation_split_percentage")
    queue.cancel(engine, repo.get_run(engine, bare).job_id)
    studio["sft_run"] = run.id


# ---- cancelling an export or an eval while the worker runs it ------------------------------
# (trial finding: refusals said "cancel it", but only training could be.) The SFT run's export
# and eval jobs run in the worker loop in a thread (the real lease keeper reads the cancel flag)
# with their real job functions, each held at a chosen point by a gate that keeps calling the
# job's own cancel check, so the cancel lands exactly there: the export after its adapter folder
# is written (verification under way), the eval after its table file is written and registered
# (the cancel arrives as the job returns). Either way nothing of it may stay.
def _sft_run(studio) -> str:
    if "sft_run" not in studio:
        pytest.skip("needs the SFT run")
    return studio["sft_run"]


def _serve_in_thread(w) -> threading.Thread:
    t = threading.Thread(target=w.serve, kwargs={"once": True}, daemon=True)
    t.start()
    return t


def _hold(check, what: threading.Event, timeout: float = 30.0) -> None:
    """Set ``what``, then keep calling the job's own ``check`` until it raises (the cancel)."""
    what.set()
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        check()
        time.sleep(0.02)
    raise AssertionError("the job was never cancelled")


def test_cancel_a_running_export_leaves_no_files(studio, monkeypatch) -> None:
    from worker.jobs import export as export_job

    c, bob, engine, run_id = studio["client"], studio["bob"], studio["engine"], _sft_run(studio)
    real = export_job.export_run
    written = threading.Event()

    def gated(run_dir, spec, out, progress, **kw):
        def gate(stage: str, frac: float) -> None:
            if stage.startswith("verify") and not written.is_set():
                _hold(lambda: progress(stage, frac), written)
            progress(stage, frac)
        return real(run_dir, spec, out, gate, **kw)

    monkeypatch.setattr(export_job, "export_run", gated)
    r = c.post(f"/api/runs/{run_id}/exports", json={"format": "adapter"})
    assert r.status_code == 201, r.text
    export_id = r.json()["id"]
    t0 = time.monotonic()
    t = _serve_in_thread(studio["worker"])
    assert written.wait(60), "the export never got to its verification"
    folder = studio["app"].state.settings.data_dir / "exports" / f"export-{export_id}"
    assert (folder / "adapter" / "adapter_config.json").is_file()  # written, not yet verified
    page = c.get(f"/runs/{run_id}/exports").text
    assert f'id="cancel-export-{export_id}"' in page and f'hx-confirm="Cancel export {export_id}?' \
        in page
    # another user: 404 on both surfaces, and the export keeps running
    assert bob.post(f"/api/exports/{export_id}/cancel").status_code == 404
    assert bob.post(f"/exports/{export_id}/cancel").status_code == 404
    assert queue.get_job(engine, export_id).state == JobState.RUNNING
    r = c.post(f"/api/exports/{export_id}/cancel")
    assert r.status_code == 200 and r.json()["id"] == export_id, r.text
    assert r.json()["status"] == "running" and r.json()["cancel_requested"] is True
    t.join(30)
    assert not t.is_alive()
    took = time.monotonic() - t0
    job = queue.get_job(engine, export_id)
    assert job.state == JobState.CANCELLED and job.result is None
    assert not folder.exists()
    assert [a for a in repo.list_artifacts(engine, run_id) if a.job_id == export_id] == []
    info = c.get(f"/api/exports/{export_id}").json()
    assert info["status"] == "cancelled" and info["files"] == []
    r = c.post(f"/api/exports/{export_id}/cancel")
    assert r.status_code == 409 and r.json()["error"]["message"] == (
        f"export {export_id} is already cancelled; only a queued or running job can be cancelled")
    page = c.get(f"/runs/{run_id}/exports").text
    assert f'id="cancel-export-{export_id}"' not in page
    assert f'action="/exports/{export_id}/delete"' in page
    print(f"export queued -> cancelled in {took:.1f} s")


def test_cancel_a_queued_export_from_the_run_page(studio) -> None:
    c, engine, run_id = studio["client"], studio["engine"], _sft_run(studio)
    r = c.post(f"/api/runs/{run_id}/exports", json={"format": "gguf", "quantization": "Q8_0"})
    assert r.status_code == 201
    export_id = r.json()["id"]
    r = c.post(f"/exports/{export_id}/cancel", headers={"HX-Request": "true"})
    assert r.status_code == 200 and 'id="exports"' in r.text and "<html" not in r.text
    assert f'id="cancel-export-{export_id}"' not in r.text
    assert queue.get_job(engine, export_id).state == JobState.CANCELLED
    r = c.post(f"/exports/{export_id}/cancel", headers={"HX-Request": "true"})
    assert r.status_code == 409 and f"export {export_id} is already cancelled" in r.text
    # without htmx: back to the run page
    r = c.post(f"/api/runs/{run_id}/exports", json={"format": "adapter"})
    r = c.post(f"/exports/{r.json()['id']}/cancel", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == f"/runs/{run_id}#exports"


def test_cancel_an_eval_as_it_ends_keeps_no_table(studio, monkeypatch) -> None:
    from worker.jobs import common

    c, engine, run_id = studio["client"], studio["engine"], _sft_run(studio)
    real = common.add_artifact
    written = threading.Event()
    seen: dict[str, Path] = {}

    def gated(ctx, run, kind, path, **meta):
        real(ctx, run, kind, path, **meta)
        if kind == "checkpoint_eval":
            seen["path"] = Path(path)
            _hold(ctx.check, written)

    monkeypatch.setattr(common, "add_artifact", gated)
    r = c.post(f"/api/runs/{run_id}/checkpoints/1/evaluations", json={})
    assert r.status_code == 202, r.text
    eval_id = r.json()["id"]
    t = _serve_in_thread(studio["worker"])
    assert written.wait(60), "the eval never wrote its table"
    assert seen["path"].is_file()
    assert [a.kind for a in repo.list_artifacts(engine, run_id) if a.job_id == eval_id] == [
        "checkpoint_eval"]
    page = c.get(f"/runs/{run_id}").text
    assert f'id="cancel-eval-{eval_id}"' in page
    r = c.post(f"/evaluations/{eval_id}/cancel", headers={"HX-Request": "true"})
    assert r.status_code == 200 and 'id="evaluation"' in r.text
    assert f'id="cancel-eval-{eval_id}" disabled>Cancelling…</button>' in r.text  # stopping
    t.join(30)
    assert not t.is_alive()
    job = queue.get_job(engine, eval_id)
    assert job.state == JobState.CANCELLED and job.result is None
    assert not seen["path"].exists() and not list(seen["path"].parent.glob(".*.tmp"))
    assert [a for a in repo.list_artifacts(engine, run_id) if a.job_id == eval_id] == []
    e = c.get(f"/api/evaluations/{eval_id}").json()
    assert e["status"] == "cancelled" and e["generation_eval"] is None
    assert c.post(f"/api/evaluations/{eval_id}/cancel").status_code == 409

"""GRPO from the browser form, the JSON API and the OpenAI client (web process only)."""
from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest
from app.settings import Settings
from app.store import queue, repo
from app.store.db import reset_engines
from app.store.schema import Dataset
from app.studio import accounts
from app.web.errors import ApiError
from app.web.openai.graders import grader_rewards
from tests.web.conftest import ADMIN_PASSWORD, run_validations, signed_in

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
GSM8K = SHARED / "grpo" / "gsm8k" / "train.jsonl"
pytestmark = pytest.mark.skipif(not GSM8K.exists(), reason="no shared data")


def _app(tmp_path):
    from app.web.main import create_app

    return create_app(Settings(data_dir=tmp_path / "data", seed_dir=SHARED,
                               admin_password=ADMIN_PASSWORD))


@pytest.fixture(params=[""])
def env(request, tmp_path):
    """The app signed in as member ``maker``; the param ``"*"`` lets maker run custom rewards
    (an admin's setting on the Admin page)."""
    app = _app(tmp_path)
    with signed_in(app) as admin_client:
        engine = app.state.engine
        admin = accounts.authenticate(engine, "admin", ADMIN_PASSWORD)
        maker = accounts.create_user(engine, "maker", "maker-password-1", actor=admin)
        if getattr(request, "param", "") == "*":
            maker = accounts.set_custom_rewards(engine, admin, maker.id, True)
        _, key = accounts.create_api_key(engine, maker, "tests")
        admin_client.headers["Authorization"] = f"Bearer {key}"
        ds = repo.add_dataset(engine, Dataset(filename="gsm8k_train.jsonl", path=str(GSM8K),
                                              rows=7473, owner=maker.id))
        yield {"client": admin_client, "engine": engine, "dataset": ds.id, "app": app,
               "api_key": key, "user": maker}
    reset_engines()


def _form(dataset, **extra):
    data = {"model": "stories260K", "dataset": dataset, "name": "gsm8k grpo",
            "num_generations": "4", "max_prompt_length": "256", "max_completion_length": "128",
            "temperature": "1.0", "top_p": "1.0", "beta": "0.04", "epsilon": "0.2",
            "loss_type": "dapo", "scale_rewards": "group", "num_iterations": "1",
            "learning_rate": "5e-6", "per_device_train_batch_size": "8",
            "gradient_accumulation_steps": "1", "max_steps": "50", "lr_scheduler_type": "constant",
            "seed": "1", "r": "16", "lora_alpha": "16", "lora_dropout": "0",
            "target_modules": ["q_proj", "v_proj"], "rewards": ["numeric_match", "format"],
            "weight_numeric_match": "1", "weight_format": "0.25"}
    data.update(extra)
    return data


def test_form_page_shows_rewards_and_signature(env):
    html = env["client"].get("/runs/new/grpo").text
    for name in ("numeric_match", "exact_match", "regex_match", "format", "length_penalty"):
        assert f'value="{name}"' in html
    assert "num_generations" in html and "scale_rewards" in html
    assert "Custom Python rewards are off" in html
    # the switch is the per-user Allow on the Admin page (the environment variable is gone)
    assert "on the Admin page" in html and "WHETSTONE_ALLOW_CUSTOM_REWARDS" not in html
    assert 'href="/runs/new/grpo"' in env["client"].get("/").text


def test_form_creates_a_grpo_run(env):
    r = env["client"].post("/runs/grpo", data=_form(env["dataset"]), follow_redirects=False)
    assert r.status_code == 303, r.text[:2000]
    run_id = r.headers["location"].rsplit("/", 1)[1]
    run, job = repo.run_with_job(env["engine"], run_id)
    assert run.kind == "grpo" and job.kind == "grpo" and job.state == "queued"
    assert run.spec["num_generations"] == 4 and run.spec["target_modules"] == ["q_proj", "v_proj"]
    assert [(x["name"], x["weight"]) for x in run.spec["rewards"]] == \
        [("numeric_match", 1.0), ("format", 0.25)]
    page = env["client"].get(f"/runs/{run_id}").text
    assert "Recent samples" in page and "/static/grpo.js" in page and "reward-chart" in page
    assert env["client"].get("/static/grpo.js").status_code == 200


def test_form_errors(env):
    c = env["client"]
    r = c.post("/runs/grpo", data=_form(env["dataset"], num_generations="3"))
    assert r.status_code == 422 and "multiple of num_generations" in r.text
    r = c.post("/runs/grpo", data=_form(env["dataset"], rewards=[]))
    assert r.status_code == 422 and "choose at least one reward" in r.text
    r = c.post("/runs/grpo", data=_form(env["dataset"], rewards=["regex_match"],
                                        regex_pattern="(unclosed"))
    assert r.status_code == 422 and "does not compile" in r.text
    r = c.post("/runs/grpo", data=_form(env["dataset"], rewards=["custom"],
                                        custom_source="def reward(p, c, i):\n    return 1.0\n"))
    assert r.status_code == 422 and "not allowed" in r.text


def test_number_fields_are_refused_in_the_studios_words(env):
    """Trial s22 F2: 1e6 / 1e999 / 1.5 in whole-number fields were answered with pydantic's
    "Input should be a valid integer, unable to parse string as an integer"; now every form
    and /api say what the field takes, its range and what was given."""
    import html

    c = env["client"]
    for field, given, words in (
            ("reward_eval_samples", "1e6", "must be a whole number from 0 to 200, written in "
                                           "digits, not '1e6'"),
            ("r", "1e999", "must be a whole number from 1 to 1,024, written in digits, "
                           "not '1e999'"),
            ("seed", "1.5", "must be a whole number from 0 to 4,294,967,295, written in digits, "
                              "not '1.5'"),
            ("beta", "1e999", "must be a finite number from 0 to 100, not '1e999'"),
            ("temperature", "x", "must be a number greater than 0 and at most 10, not 'x'"),
            ("num_generations", "1", "must be from 2 to 256, not '1'")):
        r = c.post("/runs/grpo", data=_form(env["dataset"], **{field: given}))
        assert r.status_code == 422 and words in html.unescape(r.text), (field, r.text[-3000:])
        assert "Input should be" not in r.text
    r = c.post("/api/runs/grpo", json={"model": "stories260K", "dataset": env["dataset"],
                                       "rewards": [{"name": "format"}], "max_steps": 2.5})
    assert r.status_code == 422
    assert r.json()["error"]["fields"] == {"max_steps": "must be a whole number from 1 to "
                                                        "10,000,000"}


@pytest.mark.parametrize("env", ["*"], indirect=True)
def test_custom_reward_when_allowed(env):
    html = env["client"].get("/runs/new/grpo").text
    assert "def reward(prompt: str, completion: str, item: dict) -&gt; float" in html
    r = env["client"].post("/runs/grpo", follow_redirects=False, data=_form(
        env["dataset"], rewards=["custom"], weight_custom="2", custom_timeout_s="3",
        custom_memory_mb="256", custom_source="def reward(p, c, item):\n    return 1.0\n"))
    assert r.status_code == 303, r.text[:1500]
    run = repo.get_run(env["engine"], r.headers["location"].rsplit("/", 1)[1])
    # the submitter's limits are gone (the admin's reward_* settings apply), even if posted
    assert run.spec["rewards"][0]["params"] == {"source": "def reward(p, c, item):\n    return 1.0\n"}


def test_json_api(env):
    c = env["client"]
    body = {"model": "stories260K", "dataset": env["dataset"], "name": "api grpo",
            "rewards": [{"name": "numeric_match"}], "max_steps": 10}
    r = c.post("/api/runs/grpo", json=body)
    assert r.status_code == 201, r.text
    assert repo.get_run(env["engine"], r.json()["id"]).kind == "grpo"
    r = c.post("/api/runs/grpo", json={**body, "rewards": []})
    assert r.status_code == 422
    r = c.post("/api/runs/grpo", json={**body, "rewards": [{"name": "custom", "params": {
        "source": "def reward(p, c, i):\n    return 0.0\n"}}]})
    assert r.status_code == 403 and "not allowed" in r.text
    cat = c.get("/api/grpo/rewards").json()
    assert cat["custom_allowed"] is False and "item: dict" in cat["custom_signature"]


# ---- OpenAI shapes ------------------------------------------------------------------------
def test_grader_mapping():
    assert grader_rewards({"type": "string_check", "name": "ok", "input": "{{sample.output_text}}",
                           "reference": "{{item.answer}}", "operation": "eq"}) == [
        {"name": "exact_match", "weight": 1.0, "label": "ok",
         "params": {"column": "answer", "case_sensitive": True, "strip": False,
                    "contains": False, "negate": False}}]
    r = grader_rewards({"type": "string_check", "input": "{{ sample.output_text }}",
                        "reference": "Lily", "operation": "ilike"})
    assert r[0]["name"] == "regex_match" and r[0]["params"]["pattern"] == "(?i)Lily"
    r = grader_rewards({"type": "multi", "calculate_output": "0.75 * right + fmt / 4",
                        "graders": {
                            "right": {"type": "text_similarity", "input": "{{sample.output_text}}",
                                      "reference": "{{item.answer}}",
                                      "evaluation_metric": "fuzzy_match"},
                            "fmt": {"type": "python", "source": "def grade(s, i):\n return 1\n"}}})
    assert [(x["name"], x["weight"], x["label"]) for x in r] == \
        [("text_similarity", 0.75, "right"), ("custom", 0.25, "fmt")]
    assert r[1]["params"]["style"] == "openai" and r[1]["params"]["entry"] == "grade"
    for bad, needle in [
        ({"type": "score_model"}, "not supported"),
        ({"type": "string_check", "input": "{{item.question}}", "reference": "x"}, "output_text"),
        ({"type": "text_similarity", "input": "{{sample.output_text}}", "reference": "{{item.a}}",
          "evaluation_metric": "bleu"}, "bleu"),
        ({"type": "multi", "calculate_output": "max(a, b)",
          "graders": {"a": {"type": "python", "source": "x"}}}, "weighted sum"),
    ]:
        with pytest.raises(ApiError, match=needle):
            grader_rewards(bad)



def test_multi_grader_accepts_zero_negative_and_decimal_weights():
    sub = {"type": "string_check", "input": "{{sample.output_text}}",
           "reference": "{{item.answer}}", "operation": "eq"}
    graders = {"exact": sub, "fmt": {"type": "python", "source": "def grade(s, i):\n return 1\n"}}
    for expr, want in [("0 * exact", [("exact", 0.0)]),
                       ("exact * 0 + fmt", [("exact", 0.0), ("fmt", 1.0)]),
                       ("-0.5 * exact + 1.5e0 * fmt", [("exact", -0.5), ("fmt", 1.5)]),
                       ("fmt - exact / 4", [("exact", -0.25), ("fmt", 1.0)]),
                       ("-exact", [("exact", -1.0)])]:
        r = grader_rewards({"type": "multi", "calculate_output": expr, "graders": graders})
        assert sorted((x["label"], x["weight"]) for x in r) == want, expr
    for expr in ("exact / 0", "exact * fmt", "2", "exact ** 2"):
        with pytest.raises(ApiError, match="weighted sum"):
            grader_rewards({"type": "multi", "calculate_output": expr, "graders": graders})


def test_reward_columns_are_checked_at_creation(env):
    """A reward reading a column the dataset lacks is refused when the run is created, naming
    the reward/grader and listing the dataset's columns (GSM8K: question, answer)."""
    c, ds = env["client"], env["dataset"]
    r = c.post("/api/runs/grpo", json={"model": "stories260K", "dataset": ds, "rewards": [
        {"name": "format"}, {"name": "exact_match", "params": {"column": "nope"}}]})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == "rewards[1].params.column"
    assert "'exact_match'" in err["message"] and "'nope'" in err["message"]
    assert "question, answer" in err["message"] or "answer, question" in err["message"]
    r = c.post("/api/runs/grpo", json={"model": "stories260K", "dataset": ds,
                                       "prompt_column": "prompt",
                                       "rewards": [{"name": "format"}]})
    assert r.status_code == 422 and r.json()["error"]["param"] == "prompt_column"
    r = c.post("/runs/grpo", data=_form(ds, rewards=["exact_match"], exact_column="nope"))
    assert r.status_code == 422 and "&#39;nope&#39;" in r.text and "Please fix" in r.text
    graders = [
        {"type": "string_check", "name": "chk", "input": "{{sample.output_text}}",
         "reference": "{{item.nope}}", "operation": "eq"},
        {"type": "text_similarity", "name": "sim", "input": "{{sample.output_text}}",
         "reference": "{{item.nope}}", "evaluation_metric": "fuzzy_match"},
        {"type": "multi", "calculate_output": "a + b", "graders": {
            "a": {"type": "string_check", "input": "{{sample.output_text}}",
                  "reference": "{{item.answer}}", "operation": "like"},
            "b": {"type": "string_check", "input": "{{sample.output_text}}",
                  "reference": "{{item.nope}}", "operation": "like"}}}]
    for grader, label in zip(graders, ("chk", "sim", "b")):
        r = c.post("/v1/fine_tuning/jobs", json={
            "model": "stories260K", "training_file": ds,
            "method": {"type": "reinforcement", "reinforcement": {"grader": grader}}})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "method.reinforcement.grader"
        assert f"{label!r}" in err["message"] and "'nope'" in err["message"]
        assert "answer" in err["message"] and "question" in err["message"]
    assert not repo.list_runs(env["engine"])



def test_n_epochs_resolves_to_a_shown_and_capped_max_steps(env):
    from pydantic import ValidationError

    from app.store.specs import GrpoSpec

    c, ds = env["client"], env["dataset"]
    body = {"model": "stories260K", "training_file": ds, "method": {
        "type": "reinforcement", "reinforcement": {
            "grader": {"type": "string_check", "input": "{{sample.output_text}}",
                       "reference": "{{item.answer}}", "operation": "like"},
            "hyperparameters": {"n_epochs": 1}}}}
    r = c.post("/v1/fine_tuning/jobs", json=body)
    assert r.status_code == 200, r.text
    spec = r.json()["whetstone"]["spec"]
    assert spec["max_steps"] == 7473 * 4 // 4 and spec["n_epochs"] == 1  # batch 4, G 4
    page = c.get(f"/runs/{r.json()['id']}").text
    assert "max_steps = 7473" in page and "n_epochs = 1" in page
    body["method"]["reinforcement"]["hyperparameters"]["n_epochs"] = 5000
    r = c.post("/v1/fine_tuning/jobs", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "hyperparameters.n_epochs"
    assert "10,000,000" in r.json()["error"]["message"]
    body["method"]["reinforcement"]["hyperparameters"]["n_epochs"] = 1
    r = c.post("/v1/fine_tuning/jobs", json={**body, "max_steps": 40})  # trial s22 F3
    assert r.status_code == 400 and r.json()["error"]["param"] == "hyperparameters.n_epochs"
    assert "n_epochs or max_steps, not both" in r.json()["error"]["message"]
    with pytest.raises(ValidationError, match="max_steps"):
        GrpoSpec(model="m", dataset="d", rewards=[{"name": "format"}], max_steps=10_000_001)



def test_list_events_gives_grpo_samples_a_message(env):
    from app.store import events

    c = env["client"]
    r = c.post("/api/runs/grpo", json={"model": "stories260K", "dataset": env["dataset"],
                                       "rewards": [{"name": "numeric_match"}]})
    assert r.status_code == 201, r.text
    run = repo.get_run(env["engine"], r.json()["id"])
    long = "The answer is 42 because six times seven is forty-two, and so on and so forth. " * 2
    events.append_many(env["engine"], run.job_id, [
        ("metric", {"step": 3, "total_steps": 200, "loss": 0.01, "reward": 0.75}),
        ("sample", {"step": 3, "rows": [
            {"prompt": "q", "completion": long, "reward": 0.75, "advantage": 0.1, "group": 0},
            {"prompt": "q", "completion": "x", "reward": 0.0, "advantage": -0.1, "group": 0}]}),
        ("sample", {"step": 4, "rows": []})])
    data = c.get(f"/v1/fine_tuning/jobs/{run.id}/events", params={"limit": 50}).json()["data"]
    msgs = [e["message"] for e in data]
    assert not any(m.startswith("sample: /") or m.endswith(": /") for m in msgs), msgs
    assert "sample: step 3, reward 0.75 — " + long[:60] + "… (+1 more)" in msgs
    assert "sample: step 4" in msgs
    assert "Step 3/200: training loss=0.0100, mean reward=0.75" in msgs
    sample = next(e for e in data if e["message"].startswith("sample: step 3"))
    assert sample["data"]["rows"][0]["reward"] == 0.75


def test_run_page_tick_labels_and_no_tokens_per_second_for_grpo(env):
    import json
    import shutil
    import subprocess

    c = env["client"]
    r = c.post("/runs/grpo", data=_form(env["dataset"]), follow_redirects=False)
    page = c.get(r.headers["location"]).text
    assert 'id="m-tps"' not in page and "Tokens/s" not in page
    assert "/static/ticks.js" in page and c.get("/static/ticks.js").status_code == 200
    assert "ticks: { callback: tick }" in c.get("/static/grpo.js").text
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    ticks = Path(__file__).resolve().parents[2] / "static" / "ticks.js"
    out = subprocess.run(
        [node, "-e", f"global.window = {{}}; require({json.dumps(str(ticks))}); console.log("
                     "JSON.stringify([4e-7, 0, 0.5, 1234567, 0.12345, -2.5e-4, 250]"
                     ".map(window.whetstoneTick)))"],
        capture_output=True, text=True, check=True, timeout=30).stdout
    assert json.loads(out) == ["4e-7", "0", "0.5", "1.23e+6", "0.123", "-2.5e-4", "250"]


def test_prompt_dataset_page_and_no_sft_on_it(env, tmp_path):
    """A GRPO prompt dataset shows a prompt view linking to the GRPO form, stays out of the SFT
    form, and an SFT run on it is refused at creation (422 / OpenAI 400)."""
    c = env["client"]
    subset = tmp_path / "gsm8k_8.jsonl"
    subset.write_text("".join(GSM8K.read_text().splitlines(keepends=True)[:8]))
    ds = c.post("/api/grpo/datasets", files={"file": ("gsm8k_8.jsonl", subset.read_bytes())}).json()
    run_validations(c.app)
    page = c.get(f"/datasets/{ds['id']}")
    assert page.status_code == 200
    html = page.text
    assert f'href="/runs/new/grpo?dataset={ds["id"]}"' in html
    assert "Example prompts" in html and "question" in html and "answer" in html
    first = json.loads(subset.read_text().splitlines()[0])["question"]
    assert first[:40] in html.replace("&#39;", "'").replace("&#34;", '"').replace("&quot;", '"')
    for sft_only in ("max_seq_length", "No trained token", "Over max_seq_length", "chat_template",
                     f'/runs/new?dataset={ds["id"]}'):
        assert sft_only not in html, sft_only
    assert c.get(f"/datasets/{ds['id']}/report").status_code == 200
    assert ds["id"] not in c.get("/runs/new").text
    assert ds["id"] in c.get("/runs/new/grpo").text
    r = c.post("/api/runs", json={"model": "stories260K", "dataset": ds["id"]})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == "dataset" and "GRPO prompt dataset" in r.text
    r = c.post("/v1/fine_tuning/jobs", json={"model": "stories260K", "training_file": ds["id"]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "training_file"
    assert "GRPO prompt dataset" in r.json()["error"]["message"]
    assert not repo.list_runs(env["engine"])

@pytest.fixture
def server(env):
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(env["app"], host="127.0.0.1", port=port,
                                        log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    deadline = time.time() + 20
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    th.join(timeout=10)


def test_openai_client_reinforcement_job(env, server):
    import openai

    client = openai.OpenAI(base_url=server + "/v1", api_key=env["api_key"], max_retries=0, timeout=60)
    grader = {"type": "multi", "calculate_output": "0.9 * correct + 0.1 * tags", "graders": {
        "correct": {"type": "string_check", "name": "correct", "operation": "like",
                    "input": "{{sample.output_text}}", "reference": "{{item.answer}}"},
        "tags": {"type": "string_check", "name": "tags", "operation": "like",
                 "input": "{{sample.output_text}}", "reference": "</answer>"}}}
    job = client.fine_tuning.jobs.create(
        model="stories260K", training_file=env["dataset"], suffix="rl",
        method={"type": "reinforcement", "reinforcement": {
            "grader": grader, "hyperparameters": {"batch_size": 8, "learning_rate_multiplier": 2,
                                                  "n_epochs": 1}}})
    assert job.method.type == "reinforcement" and job.status == "queued"
    run = repo.get_run(env["engine"], job.id)
    assert run.kind == "grpo" and queue.get_job(env["engine"], run.job_id).kind == "grpo"
    assert [(r["name"], r["weight"]) for r in run.spec["rewards"]] == \
        [("exact_match", 0.9), ("regex_match", 0.1)]
    assert run.spec["learning_rate"] == pytest.approx(1e-5)
    # top level and method agree, relative to the GRPO default learning rate; grader echoed
    assert job.hyperparameters.learning_rate_multiplier == pytest.approx(2)
    assert job.method.reinforcement.hyperparameters.learning_rate_multiplier == pytest.approx(2)
    assert job.hyperparameters.n_epochs == 1
    assert job.method.reinforcement.grader.type == "multi"
    assert job.method.reinforcement.grader.calculate_output == "0.9 * correct + 0.1 * tags"
    assert run.spec["max_steps"] == 7473 * 4 // 8 + (1 if 7473 * 4 % 8 else 0)
    again = client.fine_tuning.jobs.retrieve(job.id)
    assert again.method.type == "reinforcement"
    with pytest.raises(openai.PermissionDeniedError):
        client.fine_tuning.jobs.create(
            model="stories260K", training_file=env["dataset"],
            method={"type": "reinforcement", "reinforcement": {"grader": {
                "type": "python", "source": "def grade(sample, item):\n    return 1.0\n"}}})
    with pytest.raises(openai.BadRequestError, match="label_model"):
        client.fine_tuning.jobs.create(
            model="stories260K", training_file=env["dataset"],
            method={"type": "reinforcement", "reinforcement": {"grader": {"type": "label_model"}}})


def test_upload_gsm8k_prompts_then_run(env, tmp_path):
    c = env["client"]
    subset = tmp_path / "gsm8k_32.jsonl"
    subset.write_text("".join(GSM8K.read_text().splitlines(keepends=True)[:32]))
    r = c.post("/api/grpo/datasets", files={"file": ("gsm8k_32.jsonl", subset.read_bytes())})
    assert r.status_code == 201, r.text
    assert r.json()["status"] == "validating"
    run_validations(c.app)
    ds = c.get(f"/api/datasets/{r.json()['id']}").json()
    assert ds["rows"] == 32 and ds["format"] == "prompts" and ds["purpose"] == "grpo"
    assert ds["report"]["prompt_column"] == "question" and ds["report"]["answer_column"] == "answer"
    assert c.get(f"/datasets/{ds['id']}").status_code == 200
    r = c.post("/api/runs/grpo", json={"model": "stories260K", "dataset": ds["id"],
                                       "rewards": [{"name": "numeric_match"}]})
    assert r.status_code == 201, r.text
    # the browser form's upload redirects to the run form with the dataset chosen
    r = c.post("/grpo/datasets", files={"file": ("g.jsonl", subset.read_bytes())},
               follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"].startswith("/datasets/file-")
    r = c.post("/api/grpo/datasets", files={"file": ("bad.jsonl", b'{"foo": 1}\n')})
    assert r.status_code == 201
    run_validations(c.app)
    bad = c.get(f"/api/datasets/{r.json()['id']}").json()
    assert bad["status"] == "error" and "no prompt column" in bad["error"]


def _checked_rewards(page: str) -> set[str]:
    import re

    return {m for tag in re.findall(r'<input[^>]*name="rewards"[^>]*>', page)
            if "checked" in tag for m in re.findall(r'value="([^"]+)"', tag)}


def test_numeric_match_only_where_every_reference_holds_a_number(env, tmp_path):
    """Trial s22 F10: a prompt set with text answers (identity_alpaca: instruction -> output)
    got numeric_match ticked by default, the run was accepted and failed at its first step
    ("the reference in column 'output' has no number"), after its wait in the queue. The
    report now counts the numbers of each column; the form ticks text_similarity there; a
    run asking numeric_match of a column with a row without a number is refused at once,
    naming the row."""
    c = env["client"]

    def upload(name: str, body: bytes) -> dict:
        r = c.post("/api/grpo/datasets", files={"file": (name, body)})
        assert r.status_code == 201, r.text
        run_validations(c.app)
        return c.get(f"/api/datasets/{r.json()['id']}").json()

    text = upload("identity.json", (SHARED / "sft" / "identity_alpaca.json").read_bytes())
    assert text["report"]["answer_column"] == "output"
    counted = text["report"]["numbers"]["output"]
    assert counted["rows"] == 91 and counted["first_without"] == 1 and counted["with_number"] < 91
    gsm = upload("gsm8k_32.jsonl", "".join(GSM8K.read_text().splitlines(keepends=True)[:32])
                 .encode())
    assert gsm["report"]["numbers"]["answer"] == {"rows": 32, "with_number": 32,
                                                  "first_without": None, "example": None}

    assert _checked_rewards(c.get(f"/runs/new/grpo?dataset={text['id']}").text) == \
        {"text_similarity", "format"}
    assert _checked_rewards(c.get(f"/runs/new/grpo?dataset={gsm['id']}").text) == \
        {"numeric_match", "format"}

    body = {"model": "stories260K", "dataset": text["id"], "max_steps": 2,
            "rewards": [{"name": "format"}, {"name": "numeric_match"}]}
    r = c.post("/api/runs/grpo", json=body)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == "rewards[1]" and "row 1 has none" in err["message"] \
        and "1 of 91 rows of column 'output' holds one" in err["message"] \
        and "exact_match or text_similarity" in err["message"], err
    r = c.post("/runs/grpo", data=_form(text["id"], max_steps="2"))
    assert r.status_code == 422 and "row 1 has none" in r.text
    r = c.post("/api/runs/grpo", json={**body, "rewards": [{"name": "text_similarity"}]})
    assert r.status_code == 201, r.text
    # a column with a number in every row may be named for numeric_match
    mixed = upload("mixed.jsonl", b'{"question": "two plus two?", "sum": 4, "note": "x"}\n'
                                  b'{"question": "three plus four?", "sum": 7, "note": "y"}\n')
    r = c.post("/api/runs/grpo", json={**body, "dataset": mixed["id"],
                                       "rewards": [{"name": "numeric_match",
                                                    "params": {"column": "sum"}}]})
    assert r.status_code == 201, r.text
    r = c.post("/api/runs/grpo", json={**body, "dataset": mixed["id"],
                                       "rewards": [{"name": "numeric_match",
                                                    "params": {"column": "note"}}]})
    assert r.status_code == 422 and "no row of column 'note' holds one" in r.text, r.text


def test_upload_form_names_the_prompt_column(env):
    """Rows without a recognisable prompt column: the upload form takes prompt_column and
    answer_column, and a refused upload shows its error without the "fields below" banner."""
    c = env["client"]
    page = c.get("/runs/new/grpo").text
    upload = page.split('action="/grpo/datasets', 1)[1].split("</form>", 1)[0]
    assert 'name="prompt_column"' in upload and 'name="answer_column"' in upload
    assert 'hx-disabled-elt="find button[type=\'submit\']"' in page.split('id="grpo_form"', 1)[1]
    rows = b'{"task": "What is 2+2?", "gold": "4"}\n{"task": "What is 3+3?", "gold": "6"}\n'
    r = c.post("/grpo/datasets", files={"file": ("q.jsonl", rows)})
    run_validations(c.app)
    assert r.status_code == 200 and "no prompt column" in c.get(r.url).text
    r = c.post("/grpo/datasets", files={"file": ("q.jsonl", rows)},
               data={"prompt_column": "task", "answer_column": "gold"}, follow_redirects=False)
    assert r.status_code == 303, r.text[:2000]
    ds_id = r.headers["location"].rsplit("/", 1)[1]
    run_validations(c.app)
    ds = repo.get_dataset(env["engine"], ds_id)
    assert ds.report["prompt_column"] == "task" and ds.report["answer_column"] == "gold"
    # a run on it that names no column uses the columns chosen at upload
    r = c.post("/api/runs/grpo", json={"model": "stories260K", "dataset": ds_id,
                                       "rewards": [{"name": "numeric_match"}]})
    assert r.status_code == 201, r.text
    run = repo.run_with_job(env["engine"], r.json()["id"])[0]
    assert run.spec["prompt_column"] == "task" and run.spec["answer_column"] == "gold"


def test_prompt_and_completion_longer_than_the_context_are_refused(env, tmp_path):
    """max_prompt_length + max_completion_length beyond the model's max_position_embeddings is
    a field error naming the field (form and API), as SFT's max_seq_length is, not a run that
    generates past the window (the fresh-user trial had max_prompt_length 100000 accepted on
    stories260K's 512); a length the caller did not name shrinks to fit."""
    from app.studio.seqlen import context_window

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    model = repo.get_model(env["engine"], "stories260K")
    repo.update_model(env["engine"], model.id, path=str(folder), status="ready",
                      info={**(model.info or {}), "max_position_embeddings": 512})
    assert context_window(repo.get_model(env["engine"], "stories260K")) == 512
    c = env["client"]
    body = {"model": "stories260K", "dataset": env["dataset"], "name": "long",
            "rewards": [{"name": "numeric_match"}], "max_steps": 2}
    window = "stories260K's context window (512 tokens, max_position_embeddings)"
    for extra, field, words in (
            ({"max_prompt_length": 100000}, "max_prompt_length",
             f"max_prompt_length 100000 + max_completion_length 256 = 100256 tokens is longer "
             f"than {window}, which must hold a prompt and its completion together; use "
             f"max_prompt_length 256 or less with this completion length"),
            ({"max_prompt_length": 300, "max_completion_length": 300}, "max_prompt_length",
             "lower either (max_prompt_length 212 or less with this completion length, or "
             "max_completion_length 212 or less with this prompt length)"),
            ({"max_completion_length": 100000}, "max_completion_length",
             f"100000 tokens is longer than {window}"),
            ({"max_completion_length": 512}, "max_completion_length",
             f"512 tokens fills {window}")):
        r = c.post("/api/runs/grpo", json={**body, **extra})
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["param"] == field and words in err["message"], err
    r = c.post("/runs/grpo", data=_form(env["dataset"], max_prompt_length="100000"),
               headers={"HX-Request": "true"})
    assert "use max_prompt_length 384 or less" in r.text.replace("&#39;", "'")  # form: 128
    # the trial's form: both lengths sent, the completion is what outgrew the window
    r = c.post("/runs/grpo", data=_form(env["dataset"], max_prompt_length="100",
                                        max_completion_length="500"),
               headers={"HX-Request": "true"})
    text = r.text.replace("&#39;", "'")
    message = (f"max_prompt_length 100 + max_completion_length 500 = 600 tokens is longer than "
               f"{window}, which must hold a prompt and its completion together; lower either "
               f"(max_completion_length 412 or less with this prompt length, or "
               f"max_prompt_length 12 or less with this completion length)")
    at = text.index('name="max_completion_length"')
    assert text.index(f'<span class="field-error" role="alert">{message}</span>') > at
    assert text.index('name="max_prompt_length"') < at
    r = c.post("/runs/grpo", data=_form(env["dataset"], max_completion_length="4096"),
               headers={"HX-Request": "true"})
    assert f"4096 tokens is longer than {window}" in r.text.replace("&#39;", "'")
    assert "prompt + completion must fit the model&#39;s context window" in \
        c.get("/runs/new/grpo").text
    assert repo.list_runs(env["engine"]) == []
    # fits exactly; an unnamed max_prompt_length (256) shrinks to what the completion leaves
    r = c.post("/api/runs/grpo", json={**body, "max_prompt_length": 384,
                                       "max_completion_length": 128})
    assert r.status_code == 201, r.text
    r = c.post("/api/runs/grpo", json={**body, "max_completion_length": 448})
    assert r.status_code == 201, r.text
    run = repo.run_with_job(env["engine"], r.json()["id"])[0]
    assert (run.spec["max_prompt_length"], run.spec["max_completion_length"]) == (64, 448)


def test_openai_files_accepts_prompt_files_for_reinforcement(env, server, tmp_path):
    """GSM8K rows and OpenAI RFT rows (messages ending on a user turn) upload through /v1/files
    as prompt datasets; a reinforcement job runs on them, an SFT job is refused with the reason."""
    import openai

    client = openai.OpenAI(base_url=server + "/v1", api_key=env["api_key"], max_retries=0, timeout=60)
    rft = tmp_path / "rft.jsonl"
    rft.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{i} + 1?"}],
                                       "answer": str(i + 1)}) + "\n" for i in range(6)))
    for path in (GSM8K, rft):
        with open(path, "rb") as fh:
            f = client.files.create(file=fh, purpose="fine-tune")
        assert f.status == "uploaded"  # validated in the background
        run_validations(env["app"])
        f = client.files.retrieve(f.id)
        ds = repo.get_dataset(env["engine"], f.id)
        assert f.status == "processed" and ds.format == "prompts"
        assert "answer" in ds.report["columns"] and ds.report["sft_error"]
        job = client.fine_tuning.jobs.create(
            model="stories260K", training_file=f.id, method={
                "type": "reinforcement", "reinforcement": {"grader": {
                    "type": "string_check", "name": "ok", "operation": "eq",
                    "input": "{{sample.output_text}}", "reference": "{{item.answer}}"}}})
        assert job.status == "queued"
        with pytest.raises(openai.BadRequestError, match="GRPO prompt dataset"):
            client.fine_tuning.jobs.create(model="stories260K", training_file=f.id)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"x": 1}\n')
    with open(bad, "rb") as fh:
        f = client.files.create(file=fh, purpose="fine-tune")
    run_validations(env["app"])
    f = client.files.retrieve(f.id)
    assert f.status == "error" and "could not detect the dataset format" in f.status_details


BROKEN_CHAT = b"".join(json.dumps(r).encode() + b"\n" for r in (
    {"messages": [{"role": "user", "content": "hi"}]},
    {"messages": [{"role": "usr", "content": "hi"}, {"role": "assistant", "content": ""}]},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]}))


def test_broken_chat_file_is_rejected_on_every_upload_surface(env):
    """A messages file with unknown roles / an empty assistant turn is rejected by the Datasets
    page and by /v1/files alike (never reclassified as GRPO prompts); the GRPO upload lists
    each bad row by number with its reason."""
    c = env["client"]
    r = c.post("/datasets", files={"file": ("broken.jsonl", BROKEN_CHAT)}, follow_redirects=False)
    assert r.status_code == 303, r.text
    page_id = r.headers["location"].rsplit("/", 1)[-1]
    r = c.post("/v1/files", data={"purpose": "fine-tune"},
               files={"file": ("broken.jsonl", BROKEN_CHAT)})
    assert r.status_code == 200, r.text
    v1_id = r.json()["id"]
    r = c.post("/api/grpo/datasets", files={"file": ("broken.jsonl", BROKEN_CHAT)})
    grpo_id = r.json()["id"]
    run_validations(env["app"])
    page = repo.get_dataset(env["engine"], page_id)
    assert page.status == "error" and "ends with a user turn" in page.error
    f = c.get(f"/v1/files/{v1_id}").json()
    assert f["status"] == "error", f
    assert "row 2, field 'messages[0].role': unknown role 'usr'" in f["status_details"]
    assert "row 3, field 'messages[1].role': unknown role 'bot'" in f["status_details"]
    assert repo.get_dataset(env["engine"], v1_id).format != "prompts"
    grpo = c.get(f"/api/datasets/{grpo_id}").json()
    assert grpo["report"]["valid_rows"] == 1
    assert [(i["row"], i["field"]) for i in grpo["report"]["invalid"]] == [
        (2, "messages[0].role"), (3, "messages[1].role")]
    html = c.get(f"/datasets/{grpo_id}").text
    assert "unknown role &#39;bot&#39;" in html or "unknown role 'bot'" in html


def test_unknown_lora_target_is_a_field_error(env, tmp_path):
    """target_modules are checked against the model's weight names (safetensors header) when a
    run is created (SFT and GRPO), listing the modules the layers do have."""
    import struct

    folder = tmp_path / "m"
    folder.mkdir()
    header = json.dumps({f"model.layers.0.{n}.weight": {"dtype": "F32", "shape": [1],
                                                        "data_offsets": [0, 4]}
                         for n in ("self_attn.q_proj", "mlp.down_proj", "input_layernorm")})
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header.encode()
                                               + b"\0" * 4)
    model = repo.get_model(env["engine"], "stories260K")
    repo.update_model(env["engine"], model.id, path=str(folder), status="ready")
    c = env["client"]
    grpo = {"model": "stories260K", "dataset": env["dataset"], "rewards": [{"name": "format"}],
            "max_completion_length": 64}
    for url, body in (("/api/runs/grpo", grpo), ("/api/runs", {"model": "stories260K",
                                                             "dataset": env["dataset"]})):
        r = c.post(url, json={**body, "target_modules": ["q_proj", "nope_proj"]})
        assert r.status_code == 422, r.text
        assert "nope_proj is not a module of stories260K; its layers have: down_proj, q_proj" \
            in r.text
    assert c.post("/api/runs/grpo", json={**grpo, "target_modules": ["q_proj"]}).status_code == 201


def test_result_files_are_retrievable_through_v1_files(env, tmp_path):
    from app.store.schema import Artifact

    from app.store.specs import GrpoSpec

    run, _ = repo.create_run(env["engine"], GrpoSpec(model="stories260K", dataset=env["dataset"],
                                                    rewards=[{"name": "numeric_match"}]),
                             kind="grpo", owner=env["user"].id)
    f = Path(env["app"].state.settings.data_dir) / "runs" / run.id / "adapter.zip"
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_bytes(b"PK-adapter-bytes")
    art = repo.add_artifact(env["engine"], Artifact(run_id=run.id, kind="adapter", name="adapter",
                                                    path=str(f), bytes=f.stat().st_size))
    c = env["client"]
    r = c.get(f"/v1/files/{art.id}")
    assert r.status_code == 200, r.text
    assert r.json()["purpose"] == "fine-tune-results" and r.json()["filename"] == "adapter.zip"
    assert c.get(f"/v1/files/{art.id}/content").content == b"PK-adapter-bytes"
    assert c.get("/v1/files/art-nope").json()["error"]["code"] == "file_not_found"
    outside = repo.add_artifact(env["engine"], Artifact(run_id=run.id, kind="adapter", name="x",
                                                        path=str(tmp_path / "elsewhere.zip")))
    assert c.get(f"/v1/files/{outside.id}/content").status_code == 404


def test_qlora_grpo_is_refused_when_every_live_worker_has_no_cuda(env):
    """GRPO with load_in_4bit, only a CPU worker live: a load_in_4bit field error (form, /api,
    OpenAI reinforcement job); once a CUDA worker is live the same request is queued."""
    from app.store import workers

    c, eng = env["client"], env["engine"]
    workers.register(eng, "w-cpu", "box", 11, "cpu (4 cores, x86_64)")
    why = "QLoRA (load_in_4bit) needs a CUDA GPU, and no live worker has one"
    r = c.post("/runs/grpo", data=_form(env["dataset"], load_in_4bit="true"))
    assert r.status_code == 422
    assert f'<span class="field-error" role="alert">{why}' in r.text
    body = {"model": "stories260K", "dataset": env["dataset"], "rewards": [{"name": "format"}],
            "max_steps": 10, "load_in_4bit": True}
    r = c.post("/api/runs/grpo", json=body)
    assert r.status_code == 422 and r.json()["error"]["param"] == "load_in_4bit"
    assert why in r.json()["error"]["message"]
    r = c.post("/v1/fine_tuning/jobs", json={
        "model": "stories260K", "training_file": env["dataset"], "method": {
            "type": "reinforcement", "reinforcement": {
                "grader": {"type": "string_check", "name": "s", "operation": "eq",
                           "input": "{{sample.output_text}}", "reference": "{{item.answer}}"},
                "hyperparameters": {"load_in_4bit": True, "max_steps": 10}}}})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "load_in_4bit"
    assert err["code"] == "invalid_value" and why in err["message"]
    workers.register(eng, "w-gpu", "box", 12, "cuda:0 NVIDIA H200")
    r = c.post("/api/runs/grpo", json=body)
    assert r.status_code == 201 and r.json()["spec"]["load_in_4bit"] is True


def test_form_reports_every_bad_field_at_once_each_at_its_field(env):
    """Trial: batch × accumulation vs num_generations showed only in the memory section, and a
    too-long name only on the next submit."""
    r = env["client"].post("/runs/grpo", data=_form(env["dataset"], name="n" * 300,
                                                    per_device_train_batch_size="3"))
    assert r.status_code == 422
    rule = ("per_device_train_batch_size × gradient_accumulation_steps (3) must be a multiple "
            "of num_generations (4)")
    for name in ("num_generations", "per_device_train_batch_size", "gradient_accumulation_steps"):
        label = r.text.split(f'<code class="small">{name}</code>', 1)[1].split("</label>", 1)[0]
        assert rule in label, (name, label)
    name_label = r.text.split('<code class="small">name</code>', 1)[1].split("</label>", 1)[0]
    assert "at most 100 characters (this one has 300)" in name_label

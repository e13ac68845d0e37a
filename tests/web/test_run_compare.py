"""Compare two runs (issue 16): the config diff, both runs' loss and eval-loss curves and their
evaluation tables, on the page and through /api. The worker is simulated through the store
(claim, metric events, finish with a result), the channel it uses."""
from __future__ import annotations

import html
import json
import re

from app.store import events, queue, repo
from app.studio import accounts
from tests.web.conftest import ADMIN_PASSWORD, ADMIN_USER, signed_in, upload_sft


def _trained(client, engine, ds: str, worker: str, steps: int, **spec) -> str:
    r = client.post("/api/runs", json={"model": "stories260K", "dataset": ds, "max_steps": steps,
                                       "validation_split_percentage": 10, "eval_steps": 2,
                                       **spec})
    assert r.status_code == 201, r.text
    run = repo.get_run(engine, r.json()["id"])
    assert queue.claim(engine, worker, 30, kinds=["train"]).id == run.job_id
    lr = spec.get("learning_rate", 2e-4)
    events.append_many(engine, run.job_id, [
        ("metric", {"step": s, "total_steps": steps, "loss": round(3 - s * lr * 100, 6)})
        for s in range(1, steps + 1)] + [
        ("metric", {"step": s, "total_steps": steps, "eval_loss": round(3.5 - s * lr * 50, 6)})
        for s in range(0, steps + 1, 2)])
    gen = {"summary": {"samples": 1, "base_exact_match": 0.0, "fine_tuned_exact_match": 1.0,
                       "base_token_f1": 0.25, "fine_tuned_token_f1": 1.0},
           "rows": [{"row": 3, "prompt": "Who are you?", "reference": f"I am {worker}.",
                     "base": "Once upon a time", "base_exact_match": False, "base_token_f1": 0.25,
                     "fine_tuned": f"I am {worker}.", "fine_tuned_exact_match": True,
                     "fine_tuned_token_f1": 1.0}]}
    assert queue.finish(engine, run.job_id, worker, {"steps": steps, "final_loss": 1.5,
                                                     "generation_eval": gen})
    return run.id


def test_compare_two_runs(app, client, engine):
    ds = upload_sft(client)
    a = _trained(client, engine, ds, "w-a", 4, learning_rate=1e-3, r=8)
    b = _trained(client, engine, ds, "w-b", 6, learning_rate=2e-3, r=16, name="wider")

    r = client.get(f"/api/runs/{a}/compare", params={"other": b})
    assert r.status_code == 200, r.text
    cmp = r.json()
    assert {d["field"]: (d["a"], d["b"]) for d in cmp["diff"]} == {
        "learning_rate": (1e-3, 2e-3), "r": (8, 16), "max_steps": (4, 6)}
    assert cmp["a"]["curves"]["loss"] == [[s, round(3 - s * 0.1, 6)] for s in range(1, 5)]
    assert cmp["b"]["curves"]["eval_loss"] == [[s, round(3.5 - s * 0.1, 6)] for s in (0, 2, 4, 6)]
    assert cmp["b"]["name"] == "wider" and cmp["a"]["state"] == "succeeded"

    page = client.get(f"/runs/{a}").text
    assert f'href="/runs/compare?a={a}"' in page
    page = client.get("/runs/compare", params={"a": a, "b": b}).text
    rows = re.findall(r"<tr><td><code>(\w+)</code></td><td>([^<]*)</td><td>([^<]*)</td></tr>", page)
    assert rows == [("learning_rate", "0.001", "0.002"), ("max_steps", "4", "6"), ("r", "8", "16")]
    data = json.loads(html.unescape(re.search(
        r'<script type="application/json" id="compare-data">(.*?)</script>', page, re.S).group(1)))
    assert data["a"]["curves"] == cmp["a"]["curves"] and data["b"]["label"] == "wider"
    for key, worker in (("a", "w-a"), ("b", "w-b")):  # the eval tables side by side
        table = page[page.index(f'id="generation-eval-{key}"'):]
        assert f"I am {worker}." in table[:table.index("</table>")]

    r = client.get("/runs/compare", params={"a": a, "b": a})
    assert r.status_code == 422 and "choose two different runs" in r.text
    r = client.get(f"/api/runs/{a}/compare")
    assert r.status_code == 422 and r.json()["error"]["param"] == "other"
    admin = accounts.authenticate(engine, ADMIN_USER, ADMIN_PASSWORD)
    accounts.create_user(engine, "bea", "bea-password-1", actor=admin)
    with signed_in(app, "bea", "bea-password-1") as bea:
        assert bea.get("/runs/compare", params={"a": a, "b": b}).status_code == 404
        assert bea.get(f"/api/runs/{a}/compare", params={"other": b}).status_code == 404
        assert a not in bea.get("/runs/compare").text  # the pickers list only bea's runs


def _grpo(client, engine, worker: str, steps: int, rewards: list[dict], name: str | None = None,
          **spec) -> str:
    """A GRPO run of the admin's on GSM8K, trained through the store: each step's mean reward
    (overall and per function), KL and GRPO loss; finished with its reward eval."""
    from pathlib import Path

    from app.store.schema import Dataset
    from app.store.specs import GrpoSpec

    me = client.get("/api/me").json()["id"]
    gsm = Path(__file__).resolve().parents[3] / "shared" / "data" / "grpo" / "gsm8k" / "test.jsonl"
    ds = repo.add_dataset(engine, Dataset(filename="gsm8k-test.jsonl", path=str(gsm),
                                          format="prompt", owner=me))
    run, job = repo.create_run(engine, GrpoSpec(
        model="stories260K", dataset=ds.id, max_steps=steps, rewards=rewards,
        validation_split_percentage=5, num_generations=4, per_device_train_batch_size=4,
        **spec), kind="grpo", owner=me, name=name)
    assert queue.claim(engine, worker, 30, kinds=["grpo"]).id == job.id
    names = [f.get("label") or f["name"] for f in rewards]
    events.append_many(engine, job.id, [("metric", {
        "step": s, "total_steps": steps, "loss": 0.0 if s % 2 else 2e-7, "kl": 0.01 * s,
        "reward": 0.1 * s, **{f"reward/{n}": 0.05 * s * (i + 1) for i, n in enumerate(names)}})
        for s in range(1, steps + 1)])
    summary = {"samples": 2, "base_reward": 0.1, "fine_tuned_reward": 0.4,
               "functions": [{"name": n, "weight": 1.0, "base": 0.1, "fine_tuned": 0.4}
                             for n in names], "accuracy": []}
    rows = [{"row": 7, "prompt": f"{worker} counts apples", "reference": "3",
             "base": "Once", "base_reward": 0.0, "base_rewards": {n: 0.0 for n in names},
             "base_tokens": 4, "fine_tuned": "3", "fine_tuned_reward": 1.0,
             "fine_tuned_rewards": {n: 1.0 for n in names}, "fine_tuned_tokens": 1}]
    assert queue.finish(engine, job.id, worker, {
        "steps": steps, "first_reward": 0.1, "final_reward": 0.1 * steps,
        "reward_eval": {"summary": summary, "rows": rows}})
    return run.id


def test_compare_grpo_runs_by_their_rewards(client, engine):
    """Trial s22 F1: comparing GRPO runs showed only their GRPO loss (0, 2e-7, ... nothing to
    compare by) and file ids; now the mean reward per function and overall, the KL, the
    reward figures and the reward eval tables, the rewards and dataset in words."""
    fmt = {"name": "regex_match", "label": "has_number", "params": {"pattern": r"\d"}}
    a = _grpo(client, engine, "w-ga", 4, [{"name": "numeric_match"}])
    b = _grpo(client, engine, "w-gb", 6, [{"name": "numeric_match"}, {**fmt, "weight": 0.5}],
              temperature=1.3)
    cmp = client.get(f"/api/runs/{a}/compare", params={"other": b}).json()
    assert cmp["b"]["curves"]["reward"] == [[s, 0.1 * s] for s in range(1, 7)]
    assert cmp["b"]["curves"]["kl"] == [[s, 0.01 * s] for s in range(1, 7)]
    assert cmp["b"]["curves"]["rewards"] == {
        "numeric_match": [[s, 0.05 * s] for s in range(1, 7)],
        "has_number": [[s, 0.1 * s] for s in range(1, 7)]}
    assert {k: v for k, v in cmp["a"]["result"].items() if k != "train_runtime"} == {
        "steps": 4, "first_reward": 0.1, "final_reward": 0.4}
    diff = {d["field"]: d for d in cmp["diff"]}
    assert set(diff) == {"rewards", "temperature", "max_steps", "dataset"}
    assert diff["rewards"]["a_label"] == "numeric_match ×1"
    assert diff["rewards"]["b_label"] == (r"numeric_match ×1; regex_match ×0.5 "
                                          r"(label=has_number, pattern=\d)")
    ds_a = repo.get_run(engine, a).dataset_id
    assert diff["dataset"]["a"] == ds_a and diff["dataset"]["a_label"] == f"gsm8k-test.jsonl ({ds_a})"

    page = client.get("/runs/compare", params={"a": a, "b": b}).text
    assert 'id="reward-section"' in page and 'id="loss-section"' not in page
    rows = {f: html.unescape(y) for f, _, y in re.findall(
        r"<tr><td><code>(\w+)</code></td><td>([^<]*)</td><td>([^<]*)</td></tr>", page)}
    assert rows["rewards"] == r"numeric_match ×1; regex_match ×0.5 (label=has_number, pattern=\d)"
    assert 'data-result="final_reward">final mean reward <strong>0.6' in page
    assert "first loss" not in page and "No evaluation results yet" not in page
    for key, worker in (("a", "w-ga"), ("b", "w-gb")):  # the reward evals side by side
        table = page[page.index(f'id="reward-eval-{key}"'):]
        assert f"{worker} counts apples" in table[:table.index("</table>")]

    ds = upload_sft(client)  # an SFT run beside a GRPO run: both sections, each its own runs
    sft = _trained(client, engine, ds, "w-s", 4)
    page = client.get("/runs/compare", params={"a": sft, "b": a}).text
    assert 'id="reward-section"' in page and 'id="loss-section"' in page
    assert "the GRPO run's rewards are below" in page

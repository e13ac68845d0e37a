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

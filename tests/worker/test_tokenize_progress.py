"""The run log's ``tokenize`` progress (the real ``train`` job on stories260K on the CPU, in an
in-process worker loop): its total stays the dataset's valid rows from the first event to the
last, so rows left out for having no trained token no longer look like rows lost ("64/95" then
"92/92" in a fresh user's trial); the last event says how many are kept."""
from __future__ import annotations

import json

import pytest

from app.store import events, repo
from app.store.schema import JobState
from tests.conftest import SHARED_DATA, STORIES
from tests.worker.conftest import inline_studio

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not (STORIES / "stories260K.bin").exists(),
                                                  reason=f"no test data at {SHARED_DATA}")]


def test_tokenize_progress_keeps_its_total_when_rows_are_left_out(tmp_path):
    long = " ".join(f"word{i}" for i in range(120))  # the prompt alone fills 96 tokens
    rows = [{"instruction": long if i in (10, 40, 80) else f"say {i}", "output": f"ok {i}"}
            for i in range(95)]
    data = tmp_path / "rows95.json"
    data.write_text(json.dumps(rows))
    with inline_studio(tmp_path / "data", [data], "w-tokenize") as studio:
        c = studio["client"]
        ds = studio["ids"][data.name]
        assert c.get(f"/api/datasets/{ds}").json()["rows"] == 95
        r = c.post("/api/runs", json={"model": "stories260K", "dataset": ds, "max_steps": 1,
                                      "per_device_train_batch_size": 2, "r": 2,
                                      "max_seq_length": 96, "chat_template": "chatml"})
        assert r.status_code == 201, r.text
        studio["worker"].serve(once=True)
        run = c.get(f"/api/runs/{r.json()['id']}").json()
        assert run["state"] == JobState.SUCCEEDED, run
        job_id = repo.get_run(studio["engine"], run["id"]).job_id
        got = [(e.data["done"], e.data["total"], e.data.get("message"))
               for e in events.since(studio["engine"], job_id)
               if e.type == "progress" and e.data["stage"] == "tokenize"]
    # (the reporter keeps only the newest of back-to-back progress events: which of the
    # earlier ones were written depends on timing)
    assert {total for _, total, _ in got} == {95}
    assert [done for done, _, _ in got] == sorted(done for done, _, _ in got)
    assert got[-1] == (95, 95, "92 of 95 rows to train on, 3 left out (no trained token)")

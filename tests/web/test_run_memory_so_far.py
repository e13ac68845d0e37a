"""The run page's measured memory peak says "so far" only while the run runs (the trial's
cancelled run still read "0.75 GiB so far")."""
from __future__ import annotations

import re

from app.store import events, queue
from tests.web.test_web_exports import _queued_run


def _peak(client, run_id: str) -> str:
    html = client.get(f"/runs/{run_id}").text
    return re.search(r'id="mem-peak">(.*?)</span>', html, re.S).group(1).strip()


def test_so_far_only_while_running(client, engine):
    run_id = _queued_run(client, engine)
    job = queue.claim(engine, "w-test", 30, kinds=["train"])
    events.append_many(engine, job.id, [("metric", {"step": 3, "total_steps": 40, "loss": 4.0,
                                                    "memory_kind": "rss", "peak_gib": 0.75})])
    assert _peak(client, run_id) == "0.75 GiB so far"
    queue.cancel(engine, job.id)
    assert queue.acknowledge_cancel(engine, job.id, "w-test")
    assert _peak(client, run_id) == "0.75 GiB up to step 3"

"""The GPU dashboard over HTTP, fed by a real supervisor process (``python -m worker
--supervise`` on a simulated 24 GiB GPU) writing samples into the web app's own database: the
memory admitted to the running jobs as used, which jobs run there (a member sees the admin's job
anonymously), the history the charts draw, and the GPU idle again once the jobs end."""
from __future__ import annotations

import sys

import pytest

from app.store import queue
from app.store.schema import JobState
from tests.web.conftest import signed_in
from tests.worker.faultharness import Studio, ended, wait_for

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="processes and signals: Linux")


def _gpu(client) -> dict:
    """The one GPU of the dashboard, or {} before the supervisor registered it."""
    data = client.get("/api/gpus").json()
    assert [g["id"] for g in data["gpus"]] in ([], ["sup-gpu0"])
    return data["gpus"][0] if data["gpus"] else {}


@pytest.mark.slow
def test_dashboard_shows_a_supervisors_samples_and_jobs_live(app, client, engine, settings,
                                                            tmp_path) -> None:
    r = client.post("/api/users", json={"name": "bea", "password": "member-password-1"})
    assert r.status_code == 201, r.text
    bea, admin = r.json()["id"], client.get("/api/me").json()["id"]
    # the supervisor works on the web app's database (data dir and SQLite file)
    studio = Studio(settings.data_dir, data_dir=settings.data_dir, simulated_gpus="1x24",
                    gpu_reserve_gib=2, gpu_admit_margin=0.1, lease_seconds=10,
                    gpu_sample_seconds=0.2)
    assert studio.url == settings.resolved_database_url
    try:
        # an estimate of 6 GiB is admitted with 6 x 1.1 + 0.5 = 7.1 GiB: both fit at once
        mine = queue.enqueue(engine, "tick", {"seconds": 6.0}, owner=admin, estimate_gib=6.0)
        hers = queue.enqueue(engine, "tick", {"seconds": 6.0}, owner=bea, estimate_gib=6.0)
        studio.worker("sup", "--supervise")
        both = wait_for(lambda: (g := _gpu(client)).get("current") and len(g["jobs"]) == 2
                        and g["current"]["mem_used_gib"] == 14.2 and g, 60,
                        "a sample with both jobs running")
        assert both["live"] and both["source"] == "simulated" and both["capacity_gib"] == 22.0
        cur = both["current"]
        assert (cur["mem_used_gib"], cur["mem_total_gib"]) == (14.2, 24.0)
        assert (cur["util_pct"], cur["temp_c"], cur["power_w"]) == (None, None, None)
        assert both["name"] == "cuda:0 simulated GPU (24 GiB)"
        assert [(j["visible"], j["job_id"], j["admitted_gib"]) for j in both["jobs"]] == [
            (True, mine.id, 7.1), (True, hers.id, 7.1)]
        assert [j["owner"] for j in both["jobs"]] == ["admin", "bea"]
        h = both["history"]
        assert len(h["ts"]) == len(h["mem_used_gib"]) == len(h["jobs"]) >= 1
        assert h["ts"] == sorted(h["ts"]) and h["mem_used_gib"][-1] == 14.2
        assert h["jobs"][-1] == 2 and set(h["mem_used_gib"]) <= {0.0, 7.1, 14.2}
        page = client.get("/gpus")
        assert page.status_code == 200 and 'href="/gpus"' in page.text
        assert "14.2 of 24.0 GiB" in page.text and 'canvas data-figure="mem_used_gib"' in page.text
        assert 'hx-get="/gpus"' in page.text and "another user's job" not in page.text
        frag = client.get("/gpus", headers={"HX-Request": "true"})
        assert frag.text.lstrip().startswith('<div id="gpus"') and "<nav" not in frag.text
        assert '"mem_used_gib": [{"x": ' in frag.text  # the chart data rides along
        with signed_in(app, "bea", "member-password-1") as c:
            seen = _gpu(c)["jobs"]
            assert [(j["visible"], j["job_id"], j["owner"], j["admitted_gib"]) for j in seen] == [
                (False, None, None, 7.1), (True, hers.id, "bea", 7.1)]
            assert "another user's job" in c.get("/gpus").text
        for job in (mine, hers):
            assert wait_for(lambda j=job: ended(engine, j.id), 60, "job ended").state == \
                JobState.SUCCEEDED
        idle = wait_for(lambda: (g := _gpu(client))["current"]["mem_used_gib"] == 0.0
                        and not g["jobs"] and g, 30, "an idle sample")
        assert idle["history"]["jobs"][-1] == 0 and 14.2 in idle["history"]["mem_used_gib"]
    finally:
        studio.close()

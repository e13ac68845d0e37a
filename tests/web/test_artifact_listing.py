"""/api run reads list only artifacts whose file or folder is still on disk, without server
paths (the rows keep them)."""
from __future__ import annotations

from app.store import repo
from app.store.schema import Artifact
from tests.web.test_web_runs import _start_run


def test_listing_omits_missing_files_and_hides_server_paths(client, engine, settings):
    run_id, job = _start_run(client, engine)
    run_dir = settings.data_dir / "runs" / run_id
    (run_dir / "adapter").mkdir(parents=True)
    (run_dir / "adapter.zip").write_bytes(b"PK")
    kept = repo.add_artifact(engine, Artifact(
        run_id=run_id, job_id=job.id, kind="adapter", name="adapter.zip",
        path=str(run_dir / "adapter.zip"), bytes=2,
        meta={"folder": str(run_dir / "adapter"), "format": "peft"}))
    repo.add_artifact(engine, Artifact(run_id=run_id, job_id=job.id, kind="checkpoint",
                                       name="checkpoint-10", path=str(run_dir / "checkpoint-10"),
                                       meta={"step": 10}))
    r = client.get(f"/api/runs/{run_id}")
    arts = r.json()["artifacts"]
    assert [(a["id"], a["meta"]) for a in arts] == [(kept.id, {"format": "peft"})]
    assert str(settings.data_dir) not in r.text
    assert client.get(arts[0]["download_url"]).content == b"PK"

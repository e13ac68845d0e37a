"""The playground's model picker tells look-alike entries apart (issue: several GGUF exports of
one run, or two runs of one name, read the same): every option names its run, a GGUF file its
type, export and date, and a checkpoint's export says so; runs that share a name get their
short id and date. Real app over HTTP, the worker's export rows written through the store."""
from __future__ import annotations

import html as htmllib
import re

from app.store import queue, repo
from app.store.schema import Artifact
from app.store.specs import TrainSpec
from app.studio.playground_targets import short_date, short_id
from tests.web.test_web_exports import _queued_run


def _finish_all(engine) -> None:
    while (job := queue.claim(engine, "w-test", 30, kinds=["train"])) is not None:
        assert queue.finish(engine, job.id, "w-test", {"steps": 2})


def _gguf(engine, run_id: str, qtype: str, step: int | None = None) -> tuple[int, Artifact]:
    """A finished GGUF export of ``run_id`` with one file, as worker/jobs/export.py records it."""
    payload = {"run_id": run_id, "format": "gguf", "quantization": [qtype],
               **({"checkpoint_step": step} if step else {})}
    job = queue.enqueue(engine, "export", payload, run_id=run_id)
    assert queue.claim(engine, "w-export", 30, kinds=["export"]).id == job.id
    art = repo.add_artifact(engine, Artifact(
        run_id=run_id, job_id=job.id, kind="gguf", path=f"/nonexistent/{job.id}.gguf",
        name=f"{run_id}-{qtype}.gguf", meta={"export_id": f"export-{job.id}",
                                              "quantization": [qtype]}))
    assert queue.finish(engine, job.id, "w-export", {})
    return job.id, art


def _options(page: str) -> dict[str, str]:
    return {htmllib.unescape(v): htmllib.unescape(label) for v, label in
            re.findall(r'<option value="([^"]+)"[^>]*>([^<]+)</option>', page)}


def test_picker_entries_can_be_told_apart(client, engine):
    first = _queued_run(client, engine)
    spec = repo.get_run(engine, first).spec
    train = TrainSpec(**{k: spec[k] for k in ("model", "dataset", "max_steps")})
    twin_a, _ = repo.create_run(engine, train, name="alpaca-demo")
    twin_b, _ = repo.create_run(engine, train, name="alpaca-demo")
    solo, _ = repo.create_run(engine, train, name="solo")
    _finish_all(engine)
    e1, _ = _gguf(engine, solo.id, "Q4_K_M")
    e2, art2 = _gguf(engine, solo.id, "Q4_K_M")
    e3, _ = _gguf(engine, solo.id, "Q8_0", step=4)
    page = client.get("/playground", params={"model": "stories260K"})
    assert page.status_code == 200
    opts = _options(page.text)
    labels = list(opts.values())
    assert len(labels) == len(set(labels)), labels  # no two entries read alike
    base = f"stories260K:ft:{solo.id}"
    when = short_date(art2.created_at)
    assert opts[base] == "solo · final adapter"
    assert opts[f"{base}:{art2.id}"] == f"solo · GGUF Q4_K_M · export {e2}, {when} (llama.cpp)"
    assert f"solo · GGUF Q4_K_M · export {e1}, " in " | ".join(labels)
    assert any(v.startswith(f"solo · GGUF Q8_0 of checkpoint 4 · export {e3}, ")
               for v in labels)
    for twin in (twin_a, twin_b):
        assert opts[f"stories260K:ft:{twin.id}"] == (
            f"alpaca-demo [{short_id(twin.id)}, {short_date(twin.created_at)}] · final adapter")
    # the group names the run, its base, its date and short id
    assert (f'<optgroup label="solo (stories260K) · {short_date(solo.created_at)} · '
            f'{short_id(solo.id)}">') in page.text

"""An upload whose multipart body ends before its closing boundary (a request cut short that
still ended cleanly) is refused on every upload surface, and nothing is recorded or left on disk
(trial-break F14: it became a 3-byte dataset)."""
from __future__ import annotations

from sqlmodel import func, select

from app.store.db import session_scope
from app.store.schema import Dataset

ROW = b'{"question": "1+1?", "answer": "#### 2"}\n'
HEAD = (b'--XX\r\nContent-Disposition: form-data; name="file"; filename="cut.jsonl"\r\n'
        b"Content-Type: application/octet-stream\r\n\r\n")


def _datasets(engine) -> int:
    with session_scope(engine) as s:
        return s.exec(select(func.count()).select_from(Dataset)).one()


def test_a_body_without_its_closing_boundary_is_refused_everywhere(client, engine, settings):
    before = _datasets(engine)
    for path in ("/v1/files", "/datasets", "/api/grpo/datasets"):
        r = client.post(path, content=HEAD + ROW * 3,
                        headers={"content-type": "multipart/form-data; boundary=XX"})
        assert r.status_code == 400, (path, r.status_code, r.text[:200])
        assert "the upload was cut short" in r.text, (path, r.text[:300])
    assert _datasets(engine) == before
    assert [p.name for p in (settings.data_dir / "uploads").iterdir()] == []
    # the same body with its closing boundary is an upload
    r = client.post("/v1/files", content=HEAD + ROW * 3 + b"\r\n--XX--\r\n",
                    headers={"content-type": "multipart/form-data; boundary=XX"})
    assert r.status_code == 200, r.text
    assert r.json()["bytes"] == len(ROW * 3) and r.json()["filename"] == "cut.jsonl"

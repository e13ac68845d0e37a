"""A multipart body the parser cannot read is refused in a user's words on every upload surface
(trial-break F15: "the upload could not be read: Found invalid character 13 in header at 13"
reached the user), and nothing is recorded or left on disk."""
from __future__ import annotations

import html

import pytest
from sqlmodel import func, select

from app.store.db import session_scope
from app.store.schema import Dataset

CTYPE = {"content-type": "multipart/form-data; boundary=XX"}
ROW = b'{"question": "1+1?", "answer": "#### 2"}\n'
#: a part header with a bare CR in its name, and one whose file name is 300 000 characters
BROKEN = b"--XX\r\nContent\r-Disposition: form-data; name=\"file\"\r\n\r\n" + ROW + b"\r\n--XX--\r\n"
HUGE = (b'--XX\r\nContent-Disposition: form-data; name="file"; filename="' + b"a" * 300_000
        + b'.jsonl"\r\n\r\n' + ROW + b"\r\n--XX--\r\n")


@pytest.mark.parametrize("path", ["/v1/files", "/datasets", "/api/grpo/datasets"])
def test_a_malformed_body_is_refused_in_plain_words(client, engine, settings, path):
    with session_scope(engine) as s:
        before = s.exec(select(func.count()).select_from(Dataset)).one()
    for body, words in ((BROKEN, "it is not valid multipart/form-data"),
                        (HUGE, "a part's headers are too long")):
        r = client.post(path, content=body, headers=CTYPE)
        assert r.status_code == 400, (path, r.status_code, r.text[:200])
        text = html.unescape(r.text)  # the page escapes the apostrophe
        assert f"the upload's form data is malformed: {words}" in text, (path, text[:400])
        for internal in ("Found invalid character", "Maximum header", "could not be read"):
            assert internal not in text, (path, internal)
    with session_scope(engine) as s:
        assert s.exec(select(func.count()).select_from(Dataset)).one() == before
    assert [p.name for p in (settings.data_dir / "uploads").iterdir()] == []

"""A failed model import never echoes the content of the file it was pointed at (issue 20 #3:
registering ``/etc/passwd`` as a llama2.c checkpoint returned its first 28 bytes)."""
from __future__ import annotations

import struct
from pathlib import Path

import pytest

from app.store import events, queue, repo
from app.store.schema import JobState, Model
from tests.conftest import STORIES
from tests.worker.test_import_model import worker  # noqa: F401  (the in-process worker fixture)

PASSWD = Path("/etc/passwd")


def _import_fails(w, source_ref: str) -> tuple[str, str]:
    """Register a llama2c model from ``source_ref``, run its import; (every text it left
    behind: model error, job error and events, the model error)."""
    m = repo.add_model(w.engine, Model(name=f"m{abs(hash(source_ref)) % 10**8}", source="llama2c",
                                       source_ref=source_ref))
    job = queue.claim(w.engine, w.worker_id, 60, ["import_model"])
    assert w.run_job(job) == JobState.FAILED
    m = repo.get_model(w.engine, m.id)
    job = queue.get_job(w.engine, job.id)
    evs = " ".join(str(e.data) for e in events.since(w.engine, job.id, 0, 1000))
    assert m.status == "failed" and m.error
    return f"{m.error}\n{job.error}\n{evs}", m.error


@pytest.mark.skipif(not PASSWD.is_file(), reason="no /etc/passwd")
def test_etc_passwd_as_checkpoint_leaks_no_line(worker) -> None:  # noqa: F811
    text, error = _import_fails(worker, f"{PASSWD}|{STORIES / 'tok512.bin'}")
    raw = PASSWD.read_bytes()
    assert "not a llama2.c checkpoint" in error
    for line in raw.decode("utf-8", "replace").splitlines():
        for piece in line.split(":"):
            if len(piece) >= 4 and piece not in str(PASSWD):
                assert piece not in text, piece
    for n in struct.unpack_from("<7i", raw, 0):  # the header ints that used to be quoted
        assert str(n) not in text


def test_plausible_header_and_tokenizer_bytes_are_not_quoted(worker, tmp_path) -> None:  # noqa: F811
    secret = (4241, 8483, 3, 1, 1, 2719, 9137)  # a plausible header, then the wrong size
    ckpt = tmp_path / "ckpt.bin"
    ckpt.write_bytes(struct.pack("<7i", *secret) + b"x" * 100)
    text, error = _import_fails(worker, f"{ckpt}|{STORIES / 'tok512.bin'}")
    assert "does not match the sizes its header declares" in error
    assert not any(str(n) in text for n in secret if n > 9)

    tok = tmp_path / "tok.bin"  # a real checkpoint with a "tokenizer" of private bytes
    tok.write_bytes(struct.pack("<ifi", 7, 0.0, 9) + b"\xffSECRET-PASSPHRASE" * 40)
    text, error = _import_fails(worker, f"{STORIES / 'stories260K.bin'}|{tok}")
    assert "not a llama2.c tokenizer" in error
    assert "SECRET" not in text and "0xff" not in text

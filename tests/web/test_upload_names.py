"""Uploaded file names from a client are never stored or shown verbatim (trial defect): on every
upload surface (the Datasets page form, ``/api/grpo/datasets``, ``/v1/files``) the dataset's
name is the base name without control/format characters or leading dots, length-capped; the
file on disk is ``<id>-<safe name>`` in ``uploads/``; the page shows the name escaped. An
ordinary name is kept exactly. The multipart bodies are written by hand so the raw bytes of
the name reach the server (an HTTP client would percent-encode control characters)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from app.store import repo

ROWS = b'{"instruction": "hi", "output": "hello"}\n' * 3
PROMPTS = b'{"prompt": "1+1?", "answer": "2"}\n' * 3
BOUNDARY = "whetstone-names-7f3a"

#: (name as the client sends it, name the dataset is recorded and shown under)
CASES = [
    ("../../etc/evil.jsonl", "evil.jsonl"),
    ("C:\\Users\\ann\\My data.jsonl", "My data.jsonl"),
    ("..hidden.jsonl", "hidden.jsonl"),
    ("tab\there\x01\x7f.jsonl", "tabhere.jsonl"),
    ("rtl\u202egnp\u200b.jsonl", "rtlgnp.jsonl"),
    ("<b>bold</b>.jsonl", "b>.jsonl"),  # a "/" is a path separator: the base name is kept
    ("données utiles.jsonl", "données utiles.jsonl"),
    ("identity_alpaca.jsonl", "identity_alpaca.jsonl"),
    # a browser sends '"' as %22 and CR/LF as %0D/%0A (HTML's multipart/form-data encoding)
    ("my %22best%22 data.jsonl", 'my "best" data.jsonl'),
    ("two%0D%0Alines.jsonl", "twolines.jsonl"),
    # a name that is only an extension is that kind of file, not one "(no extension)"
    (".jsonl", "upload.jsonl"),
]


def _multipart(filename: str, content: bytes, fields: dict[str, str] | None = None
               ) -> tuple[bytes, dict[str, str]]:
    parts = []
    for k, v in (fields or {}).items():
        parts.append(f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n'
                     f"{v}\r\n".encode())
    parts.append(f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; '
                 f'filename="{filename}"\r\nContent-Type: application/octet-stream\r\n\r\n'
                 .encode() + content + b"\r\n")
    body = b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()
    return body, {"content-type": f"multipart/form-data; boundary={BOUNDARY}"}


def _upload(client, surface: str, filename: str) -> str:
    """Upload through ``surface`` (page, api, v1); returns the dataset id."""
    if surface == "page":
        body, headers = _multipart(filename, ROWS)
        r = client.post("/datasets", content=body, headers=headers, follow_redirects=False)
        assert r.status_code == 303, r.text
        return r.headers["location"].rsplit("/", 1)[1]
    if surface == "api":
        body, headers = _multipart(filename, PROMPTS)
        r = client.post("/api/grpo/datasets", content=body, headers=headers)
        assert r.status_code == 201, r.text
        return r.json()["id"]
    body, headers = _multipart(filename, ROWS, {"purpose": "fine-tune"})
    r = client.post("/v1/files", content=body, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def _check_stored(engine, settings, ds_id: str, shown: str) -> None:
    ds = repo.get_dataset(engine, ds_id)
    assert ds.filename == shown
    path = Path(ds.path)
    assert path.parent == (settings.data_dir / "uploads").resolve()
    assert path.name.startswith(f"{ds_id}-") and not path.name[len(ds_id) + 1:].startswith(".")
    assert all(c.isprintable() and c not in "/\\" for c in path.name), path.name
    assert len(path.name.encode()) <= 160 and path.is_file()


@pytest.mark.parametrize("surface", ["page", "api", "v1"])
def test_upload_names_are_sanitised_on_every_surface(client, engine, settings, surface):
    for sent, shown in CASES:
        ds_id = _upload(client, surface, sent)
        _check_stored(engine, settings, ds_id, shown)
        if surface == "v1":
            assert client.get(f"/v1/files/{ds_id}").json()["filename"] == shown
        else:
            assert client.get(f"/api/datasets/{ds_id}").json()["filename"] == shown
    # every stored file has its own name, also for names that clean up alike
    names = [n for n in os.listdir(settings.data_dir / "uploads") if not n.startswith(".")]
    assert len(names) == len(set(names)) == len(CASES)


def test_long_name_is_capped_keeping_its_extension_and_page_escapes(client, engine, settings):
    ds_id = _upload(client, "page", "x" * 900 + ".jsonl")
    ds = repo.get_dataset(engine, ds_id)
    assert len(ds.filename) == 255 and ds.filename.endswith("…" + ".jsonl")
    _check_stored(engine, settings, ds_id, ds.filename)

    ds_id = _upload(client, "page", '<img src=x onerror=alert(1)>.jsonl')
    assert repo.get_dataset(engine, ds_id).filename == '<img src=x onerror=alert(1)>.jsonl'
    page = client.get(f"/datasets/{ds_id}").text
    assert "&lt;img src=x onerror=alert(1)&gt;.jsonl" in page and "<img src=x" not in page
    listing = client.get("/datasets").text
    assert "<img src=x" not in listing and json.dumps(ds_id)[1:-1] in listing


def test_name_that_cleans_to_no_extension_is_refused_with_the_field(client):
    body, headers = _multipart("data.jsonl\x01/..", ROWS, {"purpose": "fine-tune"})
    r = client.post("/v1/files", content=body, headers=headers)
    assert r.status_code == 400 and "unsupported file type" in r.json()["error"]["message"]
    # a dot file of another kind is refused by the extension the user sees
    body, headers = _multipart(".bashrc", ROWS, {"purpose": "fine-tune"})
    r = client.post("/v1/files", content=body, headers=headers)
    assert r.status_code == 400
    assert "unsupported file type '.bashrc'" in r.json()["error"]["message"], r.text

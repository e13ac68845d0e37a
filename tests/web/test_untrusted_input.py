"""Inputs that answered 500 (issue 20): long file names, deeply nested JSON, a list where an
object belongs, export ids above 2**63."""
from __future__ import annotations

from pathlib import Path

import pytest

from app.data.errors import DatasetError
from app.store import repo
from app.studio.reports import inspect_file

ROWS = b'{"prompt": "hi", "completion": "yo"}\n' * 3


@pytest.mark.parametrize("stem", ["a" * 194, "数据" * 97, "é-" * 97])
def test_200_character_file_names_upload(client, engine, stem):
    name = stem + ".jsonl"
    assert len(name) == 200
    r = client.post("/datasets", files={"file": (name, ROWS)}, follow_redirects=False)
    assert r.status_code == 303, r.text[:300]
    ds = repo.get_dataset(engine, r.headers["location"].rsplit("/", 1)[1])
    assert ds.filename == name and ds.path.endswith(".jsonl") and Path(ds.path).is_file()
    assert len(Path(ds.path).name.encode()) <= 255

    r = client.post("/v1/files", files={"file": (name, ROWS)}, data={"purpose": "fine-tune"})
    assert r.status_code == 200, r.text[:300]
    assert r.json()["filename"] == name
    assert repo.get_dataset(engine, r.json()["id"]).path.endswith(".jsonl")


def test_deeply_nested_json_is_a_clear_error(client, tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    for path in ("/api/runs", "/v1/fine_tuning/jobs", "/api/runs/x/exports"):
        r = client.post(path, content=deep, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"], path
    for name, body in (("deep.json", deep), ("deep.jsonl", deep + "\n"),
                       ("row.jsonl", '{"text": ' + deep + "}\n")):
        f = tmp_path / name
        f.write_text(body)
        with pytest.raises(DatasetError, match="nested too deeply"):
            inspect_file(f, tokenizer_dir=None)
        r = client.post("/v1/files", files={"file": (name, body.encode())},
                        data={"purpose": "fine-tune"})
        assert r.status_code in (200, 400), r.text[:300]  # 200: validated in the background
        if r.status_code == 400:
            assert "nested too deeply" in r.json()["error"]["message"]


def test_hyperparameters_must_be_an_object(client):
    for body, param in (({"hyperparameters": [1]}, "hyperparameters"),
                        ({"hyperparameters": "fast"}, "hyperparameters"),
                        ({"method": {"type": "supervised", "supervised": [1]}}, "method.supervised"),
                        ({"method": {"type": "supervised",
                                     "supervised": {"hyperparameters": [2]}}},
                         "method.supervised.hyperparameters")):
        r = client.post("/v1/fine_tuning/jobs",
                        json={"model": "stories260K", "training_file": "file-x", **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and "must be an object" in r.text


def test_export_ids_above_2_63_are_not_found(client):
    big = 2 ** 64 + 1
    for path in (f"/api/exports/{big}", f"/api/exports/{big}/events",
                 f"/exports/{big}/download.zip"):
        r = client.get(path)
        assert r.status_code == 404, (path, r.status_code, r.text[:200])

"""A dataset that failed validation offers no "Train on this dataset", and the run form asked for
it says why it cannot be used instead of silently choosing another dataset (trial shot 12)."""
from __future__ import annotations

from tests.web.conftest import run_validations
from tests.web.test_web_exports import _queued_run


def _upload(client, name: str, body: bytes) -> str:
    r = client.post("/datasets", files={"file": (name, body)}, follow_redirects=False)
    return r.headers["location"].rsplit("/", 1)[1]


def test_failed_dataset_cannot_be_chosen_for_training(client, engine):
    good = _queued_run(client, engine) and client.get("/api/datasets").json()["data"][0]["id"]
    bad = _upload(client, "wrongkeys.jsonl", b'{"foo": 1, "bar": 2}\n{"foo": 3, "bar": 4}\n')
    run_validations(client.app)
    page = client.get(f"/datasets/{bad}").text
    assert 'id="train-link" class="button" href' not in page
    assert '<button type="button" id="train-link" disabled' in page and "failed validation" in page
    assert f'<a id="train-link" class="button" href="/runs/new?dataset={good}' in \
        client.get(f"/datasets/{good}").text

    form = client.get(f"/runs/new?dataset={bad}").text
    label = form.split('<code class="small">dataset</code>', 1)[1].split("</label>", 1)[0]
    assert "wrongkeys.jsonl" in label and "is not usable" in label, label
    assert '<option value="" selected>— choose a dataset —</option>' in label
    assert label.count(" selected") == 1  # the good dataset is listed, not silently chosen
    assert f'<option value="{good}" >' in label or f'<option value="{good}">' in label
    # asked for a usable one: no error, it is the one chosen
    form = client.get(f"/runs/new?dataset={good}").text
    label = form.split('<code class="small">dataset</code>', 1)[1].split("</label>", 1)[0]
    assert f'<option value="{good}" selected>' in label and "field-error" not in label
    missing = client.get("/runs/new?dataset=ds-nope").text
    assert "choose a dataset" in missing and "ds-nope" in missing

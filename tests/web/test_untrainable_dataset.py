"""Trial finding M-3: a dataset whose validation report shows that no row has a trained token
(its only row's answer starts past max_seq_length) is refused when a run is created on the
form, ``/api/runs`` and ``/v1/fine_tuning/jobs`` alike, naming the ``dataset`` field, instead
of queueing a run that fails later; a run the report's figures do not cover (another chat
template, every token trained) is still accepted, and the form's picker says it."""
from __future__ import annotations

import html
import json

import pytest

from app.store import repo
from app.store.schema import Model
from tests.conftest import SHARED_DATA as SHARED
from tests.web.conftest import run_validations

LONG = json.dumps({"instruction": "tell me a story " * 2000, "input": "",
                   "output": "Once upon a time."}) + "\n"
WHY = ("no row of dataset 'long.jsonl' has a trained token at max_seq_length {n} (its "
       "validation report with tiny-ready's tokenizer and the chatml chat template: its only "
       "row; row 1: the answer starts past max_seq_length (512 tokens; the row has {tokens})); "
       "shorten the prompts: max_seq_length {n} is already tiny-ready's context window")


@pytest.fixture
def untrainable(client, engine, stories_hf):
    """A ready stories260K (512-token context, no chat template of its own) and long.jsonl,
    validated with it: ``(model, dataset id, the report's token count of the row)``."""
    model = repo.add_model(engine, Model(name="tiny-ready", source="local", source_ref="x",
                                         path=str(stories_hf), status="ready", shared=True,
                                         info={"max_position_embeddings": 512}),
                           import_job=False)
    r = client.post("/datasets", files={"file": ("long.jsonl", LONG.encode())},
                    follow_redirects=False)
    assert r.status_code == 303, r.text[:300]
    assert run_validations(client.app) == 1
    ds = r.headers["location"].rsplit("/", 1)[1]
    report = client.get(f"/api/datasets/{ds}").json()["report"]
    assert (report["valid_rows"], report["no_trained_tokens"], report["max_seq_length"],
            report["model"], report["template_name"]) == (1, 1, 512, "tiny-ready", "chatml")
    return model, ds, report["max_tokens"]


@pytest.mark.parametrize("surface", ["api", "v1", "form"])
def test_a_run_on_it_is_refused_naming_the_dataset(client, untrainable, surface):
    model, ds, tokens = untrainable
    why = WHY.format(n=512, tokens=tokens)
    if surface == "api":
        r = client.post("/api/runs", json={"model": model.name, "dataset": ds, "max_steps": 2})
        assert r.status_code == 422, r.text
        assert (r.json()["error"]["param"], r.json()["error"]["message"]) == ("dataset", why)
    elif surface == "v1":
        r = client.post("/v1/fine_tuning/jobs", json={"model": model.name, "training_file": ds})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == why
        assert r.json()["error"]["param"] == "training_file"  # /v1 names its own field
    else:
        r = client.post("/runs", data={"model": model.id, "dataset": ds, "max_steps": "2",
                                       "train_on_responses_only": "on",  # ticked by default
                                       "target_modules": ["q_proj", "v_proj"]})
        assert r.status_code == 422, r.text[:300]
        label = html.unescape(r.text).split('<code class="small">dataset</code>', 1)[1] \
            .split("</label>", 1)[0]
        assert "field-error" in label and why in label
    assert repo.list_runs(client.app.state.engine) == []


def test_a_shorter_max_seq_length_is_refused_too(client, untrainable):
    model, ds, tokens = untrainable
    r = client.post("/api/runs", json={"model": model.name, "dataset": ds, "max_seq_length": 256})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["message"].startswith(
        "no row of dataset 'long.jsonl' has a trained token at max_seq_length 256 (")
    assert r.json()["error"]["param"] == "dataset"


@pytest.mark.parametrize("other", [{"chat_template": "llama3"},
                                   {"train_on_responses_only": False},
                                   {"add_template_tokens": True}])
def test_settings_the_report_does_not_cover_are_accepted(client, untrainable, other):
    model, ds, _ = untrainable
    r = client.post("/api/runs", json={"model": model.name, "dataset": ds, "max_steps": 2,
                                       **other})
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["dataset"] == ds


def test_the_form_picker_says_no_row_is_trained(client, untrainable):
    _, ds, _ = untrainable
    form = html.unescape(client.get("/runs/new").text)
    label = form.split('<code class="small">dataset</code>', 1)[1].split("</label>", 1)[0]
    option = label.split(f'<option value="{ds}"', 1)[1].split("</option>", 1)[0]
    assert "long.jsonl — SFT alpaca, 1 rows" in option
    assert option.endswith(" · no row has a trained token at max_seq_length 512")


def test_its_page_says_so_above_the_report(client, untrainable):
    """Trial s24: the page said "processed" and showed the figures, with no word that a run on
    it would be refused; it now says so, and what to change, above the report (and the report
    for other settings, which may train, has no such banner)."""
    model, ds, tokens = untrainable
    page = html.unescape(client.get(f"/datasets/{ds}").text)
    banner = page.split('id="untrained-banner">', 1)[1].split("</div>", 1)[0]
    assert banner == (
        "Nothing to train on with these settings: its only valid row has no trained token at "
        "max_seq_length 512 with tiny-ready's tokenizer and the chatml chat template (row 1: "
        f"the answer starts past max_seq_length (512 tokens; the row has {tokens})), so a run "
        "with them is refused. To train: shorten the prompts: max_seq_length 512 is already "
        "tiny-ready's context window.")
    # the row's own line gives the cause, not advice that contradicts the banner's
    why = page.split('id="untrained-rows">', 1)[1].split("</table>", 1)[0]
    assert (f"<td>1</td><td>the answer starts past max_seq_length (512 tokens; the row has "
            f"{tokens})</td>") in why and "raise max_seq_length" not in why
    # a dataset that trains: no banner
    path = SHARED / "sft" / "identity_alpaca.json"
    r = client.post("/datasets", files={"file": (path.name, path.read_bytes())},
                    follow_redirects=False)
    run_validations(client.app)
    page = client.get(r.headers["location"]).text
    assert "Valid rows" in page and "untrained-banner" not in page

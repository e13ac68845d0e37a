"""The new-run form reports every bad field in one answer, each at its field (trial: a 300-char
run name was reported only on the second submit, after the other errors were fixed)."""
from __future__ import annotations

from app.store.specs import TrainSpec
from app.studio.runs import SpecError, check_input


def _label(html: str, name: str) -> str:
    return html.split(f'<code class="small">{name}</code>', 1)[1].split("</label>", 1)[0]


def test_a_long_name_and_bad_values_in_one_answer(client):
    model = client.get("/api/models").json()["data"][0]["id"]
    r = client.post("/runs", data={"model": model, "dataset": "", "name": "x" * 300,
                                   "learning_rate": "-1", "r": "0"})
    assert r.status_code == 422
    assert "at most 100 characters (this one has 300)" in _label(r.text, "name")
    assert "must be from 1e-08 to 1, not &#39;-1&#39;" in _label(r.text, "learning_rate")
    assert "must be from 1 to 1,024, not &#39;0&#39;" in _label(r.text, "r")
    assert "choose a dataset" in r.text


def test_check_input_names_the_fields_of_a_whole_spec_rule():
    try:
        check_input(TrainSpec, {"model": "m", "dataset": "d", "max_steps": 0}, "ok\u202e")
    except SpecError as exc:
        assert set(exc.fields) == {"max_steps", "name"}, exc.fields
        assert "U+202E" in exc.fields["name"]
    else:
        raise AssertionError("no SpecError")

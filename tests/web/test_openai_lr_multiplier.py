"""/v1 ``learning_rate_multiplier``: any value above 0 up to 100 (OpenAI's API takes values
above 1 to raise the learning rate), × the method's default learning rate; anything else is a 400
naming the hyperparameter, for supervised and reinforcement jobs alike."""
from __future__ import annotations

import pytest

from app.store import repo
from tests.conftest import SHARED_DATA as SHARED
from tests.web.conftest import run_validations

GRADER = {"type": "string_check", "name": "same", "input": "{{sample.output_text}}",
          "reference": "{{item.output}}", "operation": "eq"}


@pytest.fixture()
def file_id(client):
    path = SHARED / "sft" / "alpaca_en_demo.json"
    with path.open("rb") as fh:
        r = client.post("/v1/files", files={"file": (path.name, fh)}, data={"purpose": "fine-tune"})
    run_validations(client.app)
    return r.json()["id"]


def _job(client, file_id, m, reinforcement=False):
    hp = {"learning_rate_multiplier": m}
    body = {"model": "stories260K", "training_file": file_id}
    if reinforcement:
        body["method"] = {"type": "reinforcement",
                          "reinforcement": {"grader": GRADER, "hyperparameters": hp}}
    else:
        body["hyperparameters"] = hp
    return client.post("/v1/fine_tuning/jobs", json=body)


def test_multiplier_above_one_raises_the_learning_rate(client, engine, file_id):
    for m, lr in ((2, 4e-4), (10, 2e-3), (100, 2e-2), ("0.5", 1e-4)):
        r = _job(client, file_id, m)
        assert r.status_code == 200, r.text
        assert r.json()["hyperparameters"]["learning_rate_multiplier"] == pytest.approx(float(m))
        assert repo.get_run(engine, r.json()["id"]).spec["learning_rate"] == pytest.approx(lr)


@pytest.mark.parametrize("reinforcement", [False, True])
def test_multiplier_out_of_range_is_a_400_naming_it(client, file_id, reinforcement):
    base = "5e-06" if reinforcement else "0.0002"
    for m in (5000, 100.5, 0, -1, "fast", True, "nan"):
        r = _job(client, file_id, m, reinforcement)
        assert r.status_code == 400, (m, r.text)
        err = r.json()["error"]
        assert err["param"] == "hyperparameters.learning_rate_multiplier", err
        assert err["message"] == ("learning_rate_multiplier must be a number above 0 and at most "
                                  f"100 (× the default learning rate {base}), not {m!r}"), err


def test_a_bad_learning_rate_field_is_named_as_sent(client, file_id):
    """Our TrainSpec's ``learning_rate``, sent as an extra body field or hyperparameter, is
    refused naming ``learning_rate`` (trial s24 M-6: the error named
    hyperparameters.learning_rate_multiplier, which the request did not have)."""
    for body, param in (({"learning_rate": "fast"}, "learning_rate"), ({"learning_rate": 5}, "learning_rate"),
                        ({"hyperparameters": {"learning_rate": "fast"}}, "learning_rate")):
        r = client.post("/v1/fine_tuning/jobs", json={"model": "stories260K",
                                                      "training_file": file_id, **body})
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["message"].startswith("learning_rate: "), err

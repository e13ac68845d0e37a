"""Trial findings on numbers and isolation wording (trial-break F4, F8, F9, F12, F13), each
driven over HTTP against the app:

- F4: a /v1 ``learning_rate_multiplier`` whose learning rate is below the smallest
  ``learning_rate`` (1e-300 trained with lr 2e-304 and read back 0.0) is a 400 naming it; the
  form and /api refuse such a ``learning_rate`` too, and a small valid one reads back as given.
- F8: "Jobs at once" 1.5 is "must be a whole number", named by its column; 2.0 and 1e3 are whole.
- F9: a GPU memory quota of 0.001 GiB is quoted as 0.001, not "0 GiB".
- F12: another user's run named in both compare slots is a 404, not "choose two different runs".
- F13: the compare page labels the training time as a duration, and a cancelled run shows the
  steps and losses of its loss curve.
"""
from __future__ import annotations

import re

import pytest

from app.store import events, queue, repo
from app.studio import accounts
from tests.web.conftest import ADMIN_PASSWORD, ADMIN_USER, signed_in, upload_sft
from tests.web.test_gpu_memory_quota import _quota
from tests.web.test_openai_lr_multiplier import _job
from tests.web.test_openai_lr_multiplier import file_id  # noqa: F401  (fixture)
from tests.web.test_vram_web import _llama
from tests.web.test_web_runs import _upload


@pytest.mark.parametrize("reinforcement", [False, True])
def test_a_multiplier_below_the_smallest_learning_rate_is_a_400(
        client, engine, file_id, reinforcement):  # noqa: F811
    base = "5e-06" if reinforcement else "0.0002"
    least = "0.002" if reinforcement else "5e-05"
    for m in (1e-300, 1e-6):
        r = _job(client, file_id, m, reinforcement)
        assert r.status_code == 400, (m, r.text)
        err = r.json()["error"]
        assert err["param"] == "hyperparameters.learning_rate_multiplier", err
        assert err["message"] == (f"learning_rate_multiplier {m:g} × the default learning rate "
                                  f"{base} = {m * float(base):g} is below the smallest "
                                  f"learning_rate, 1e-08: use at least {least}"), err
    # the smallest multiplier is taken, and a small one reads back as given (not rounded off)
    m = 0.00123456789 if not reinforcement else 0.0123456789
    r = _job(client, file_id, m, reinforcement)
    assert r.status_code == 200, r.text
    assert r.json()["hyperparameters"]["learning_rate_multiplier"] == m
    spec = repo.get_run(engine, r.json()["id"]).spec
    assert spec["learning_rate"] == pytest.approx(m * float(base), rel=1e-12)


def test_the_form_and_api_refuse_a_learning_rate_below_the_smallest(client):
    ds = upload_sft(client)
    r = client.post("/api/runs", json={"model": "stories260K", "dataset": ds,
                                       "learning_rate": 2e-304})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == "learning_rate", err
    assert err["fields"] == {"learning_rate": "Input should be greater than or equal to 0.00000001"}
    r = client.post("/api/runs", json={"model": "stories260K", "dataset": ds,
                                       "learning_rate": 1e-8, "max_steps": 1})
    assert r.status_code == 201, r.text

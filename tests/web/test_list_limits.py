"""One rule for every list's ``limit`` (trial s21 F11: ``-1`` was silently 1 on ``/api/runs``
and a job's events, but 400 on ``/v1/fine_tuning/jobs``): absent means the list's default;
otherwise a whole number from 1 to the list's most, else the surface's usual refusal naming
``limit`` (422 under /api, 400 under /v1); ``app.studio.paging.page_limit``."""
from __future__ import annotations

import pytest

from tests.web.test_web_runs import _upload

BAD = ("-1", "0", "2.5", "abc", "1e2", "99999999999999999999999")


@pytest.fixture
def run_id(client) -> str:
    """A queued run of the admin's (with a few events), on alpaca_en_demo.json."""
    ds = _upload(client)
    r = client.post("/api/runs", json={"model": "model-stories260K", "dataset": ds,
                                       "max_steps": 3, "save_steps": 1, "name": "limits"})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def test_every_list_refuses_a_bad_limit_naming_it(client, run_id) -> None:
    lists = {"/api/runs": (1000, 422), "/api/playground/sessions": (100, 422),
             "/v1/files": (10000, 400), "/v1/fine_tuning/jobs": (100, 400),
             f"/v1/fine_tuning/jobs/{run_id}/events": (10000, 400),
             f"/v1/fine_tuning/jobs/{run_id}/checkpoints": (100, 400)}
    for url, (most, status) in lists.items():
        for bad in (*BAD, str(most + 1)):
            r = client.get(url, params={"limit": bad})
            assert r.status_code == status, (url, bad, r.text)
            err = r.json()["error"]
            assert err["param"] == "limit" and err["code"] == "invalid_value", (url, err)
            assert err["message"].startswith(f"limit must be a whole number from 1 to {most} "), err
        for good in ("1", f" {most} ", ""):  # empty: the default
            r = client.get(url, params={"limit": good})
            assert r.status_code == 200, (url, good, r.text)

    # and the limit is the page size
    assert [j["id"] for j in client.get("/api/runs?limit=1").json()["data"]] == [run_id]
    evs = client.get(f"/v1/fine_tuning/jobs/{run_id}/events").json()
    assert len(evs["data"]) >= 1
    one = client.get(f"/v1/fine_tuning/jobs/{run_id}/events?limit=1").json()
    assert one["data"] == evs["data"][:1]
    assert len(client.get("/v1/files?limit=1").json()["data"]) == 1


def test_files_order_is_asc_or_desc_and_anything_else_is_refused_naming_it(client) -> None:
    first, second = _upload(client), _upload(client)
    ids = lambda q: [f["id"] for f in client.get("/v1/files" + q).json()["data"]]  # noqa: E731
    assert ids("")[:2] == [second, first] and ids("?order=desc")[:2] == [second, first]
    assert ids("?order=asc")[-2:] == [first, second] and ids("?order=") == ids("")
    for bad in ("ascending", "ASC", "1", "x" * 40):
        r = client.get("/v1/files", params={"order": bad})
        assert r.status_code == 400, (bad, r.text)
        err = r.json()["error"]
        assert err["param"] == "order" and err["code"] == "invalid_value", err
        assert err["message"].startswith("order must be 'asc' or 'desc', not "), err


def test_files_after_an_unknown_or_deleted_id_is_a_404_naming_after(client) -> None:
    """Trial s24 M-5: ``after=<deleted file>`` answered the first page again (a client paging on
    loops); ``/v1/fine_tuning/jobs`` already answered 404 for an unknown ``after``."""
    first, second = _upload(client), _upload(client)
    assert [f["id"] for f in client.get("/v1/files", params={"after": second}).json()["data"]][:1] \
        == [first]
    assert client.delete(f"/v1/files/{second}").status_code == 200
    for after in (second, "file-nope"):
        r = client.get("/v1/files", params={"after": after})
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["param"] == "after", err
        assert err["message"] == f"after: no file with id {after!r} to list after", err
    assert client.get("/v1/files", params={"after": ""}).status_code == 200

"""Small wording findings of the new-user trial, over HTTP: numbers printed as given."""
from __future__ import annotations


def test_too_large_max_tokens_is_printed_as_given(client) -> None:
    model = client.get("/api/models").json()["data"][0]["id"]
    for given, shown in ((1000000000, "1000000000"), ("20000", "20000"), (9000.0, "9000")):
        r = client.post("/api/playground/sessions", json={"model": model, "max_tokens": given})
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert (err["param"], err["message"]) == (
            "max_tokens", f"must be at least 1 and at most 8192, not {shown}"), err

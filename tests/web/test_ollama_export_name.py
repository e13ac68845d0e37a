"""An Ollama export's model is named after its run (trial: a run named "Bedtime stories v2"
was exported as ``stories260k-2d4e5f60``, the base model's name and the run id; nothing said
which run it was). The name is decided once (``app.studio.exports.ollama_model_name``) for the
JSON API and the run page's form alike: the run's name as Ollama allows it, the run id's tail for
uniqueness, the run id when the name leaves nothing usable."""
from __future__ import annotations

import re

from app.store import queue, repo
from app.store.specs import TrainSpec

from tests.web.test_web_exports import _queued_run

#: What Ollama accepts as a model name (types/model/name.go: at most 80 characters, the first a
#: letter, digit or ``_``); the studio's default names are lower-case.
OLLAMA_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,79}$")


def _finished_runs(client, engine, names: list[str | None]) -> list[str]:
    """Finished runs named ``names`` on a real uploaded dataset (the trainer's work simulated
    through the store, the channel the worker uses); their ids."""
    first = repo.get_run(engine, _queued_run(client, engine))
    spec = TrainSpec(**first.spec)
    ids = [repo.create_run(engine, spec, name=n)[0].id for n in names]
    while (claimed := queue.claim(engine, "w-test", 30, kinds=["train"])) is not None:
        assert queue.finish(engine, claimed.id, "w-test", {"steps": 2})
    return ids


def _ollama_name(client, engine, run_id: str, page: bool = False) -> str:
    """The model name the Ollama export of ``run_id`` queued now (by /api, or by the run
    page's form with ``page``) will create."""
    if page:
        r = client.post(f"/runs/{run_id}/exports", data={"format": "ollama",
                                                         "quantization": "Q8_0"},
                        headers={"HX-Request": "true"})
        assert r.status_code == 200, r.text
        job = repo.list_run_jobs(engine, run_id, "export")[0]
    else:
        r = client.post(f"/api/runs/{run_id}/exports",
                        json={"format": "ollama", "quantization": ["Q8_0"]})
        assert r.status_code == 201, r.text
        job = queue.get_job(engine, r.json()["id"])
    name = job.payload["model_name"]
    assert OLLAMA_NAME.match(name), name
    return name


def test_the_ollama_model_is_named_after_the_run_on_every_surface(client, engine) -> None:
    named, twin, again, long, cjk, marks, unnamed = _finished_runs(client, engine, [
        "Bedtime Stories: v2.1 (final)", "Café  __ Über ", "Café  __ Über ",
        "A very long run name " * 4, "日本語の物語", "!!! ...", None])
    want = f"bedtime-stories-v2.1-final-{named[-8:]}"
    assert _ollama_name(client, engine, named) == want
    assert _ollama_name(client, engine, named, page=True) == want  # the run page's form

    # accents fold to ASCII; another run of the same name gets a model of its own
    assert _ollama_name(client, engine, twin) == f"cafe-__-uber-{twin[-8:]}"
    assert _ollama_name(client, engine, again, page=True) == f"cafe-__-uber-{again[-8:]}"

    # a long name is cut to fit (64 characters), keeping the run's tail
    name = _ollama_name(client, engine, long)
    assert len(name) <= 64 and name.endswith(f"-{long[-8:]}"), name
    assert name.startswith("a-very-long-run-name-a-very-long-run-name-")

    # nothing Ollama allows left, or no name at all: the run id
    for run_id in (cjk, marks, unnamed):
        assert _ollama_name(client, engine, run_id) == run_id

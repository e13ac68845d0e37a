"""A playground session is a GPU job like any other: its memory estimate (base weights, a KV
cache per pane, the prefill's logits) is what admission packs by, so while it holds a simulated
24 GiB GPU a training job that does not fit beside it waits, and is admitted once the session
ends; a user's second request for the same model reuses the live session."""
from __future__ import annotations

import pytest

from app.settings import Settings
from app.store import queue, repo
from app.store.admission import need_gib
from app.store.db import session_scope
from app.store.schema import JobState, Model, User
from app.studio import playground as pg
from tests.store.test_admission_queue import GPU0, engine  # noqa: F401 - a 24 GiB GPU, the db

#: Llama-3.1-8B's shape, as a model row's ``info`` records it.
LLAMA_8B = {"layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "vocab": 128256, "max_position_embeddings": 131072}


def test_a_session_counts_in_admission_and_is_reused(engine):
    from worker.loop import CPU_KINDS, HANDLERS

    assert "playground" in HANDLERS and "playground" not in CPU_KINDS  # a supervisor admits it
    with session_scope(engine) as s:
        user = User(name="ann", password_hash="x")
        s.add(user)
        s.flush()
    repo.add_model(engine, Model(name="llama-8b", source="hf", source_ref="meta/llama",
                                 path="/nonexistent", status="ready", info=LLAMA_8B,
                                 owner=user.id), import_job=False)
    settings = Settings(playground_idle_seconds=120)
    t = pg.resolve(engine, user, "llama-8b")
    assert t.sides == ["base"] and t.template_name == "chatml"  # no template of its own
    est = pg.estimate_gib(t)
    # bf16 weights 14.96 GiB + KV cache of 4096 tokens 0.5 GiB + prefill logits 0.98 GiB + 0.2
    assert est == pytest.approx(16.64, abs=0.05)

    session, reused = pg.open_session(engine, settings, user, "llama-8b")
    assert not reused and session.estimate_gib == est and session.owner == user.id
    assert session.payload["idle_seconds"] == 120
    train = queue.enqueue(engine, "train", {"run_id": None}, owner=user.id, estimate_gib=5.0)
    got = queue.admit(engine, GPU0, 60, ["playground", "train"], 0.1, 24.0)
    assert got.id == session.id and got.admitted_gib == need_gib(est, 0.1, 22.0)
    # 18.8 GiB held: the 6 GiB training job does not fit beside the session
    assert queue.admit(engine, GPU0, 60, ["playground", "train"], 0.1, 24.0) is None
    again, reused = pg.open_session(engine, settings, user, "llama-8b")
    assert reused and again.id == session.id
    assert queue.finish(engine, session.id, got.lease_owner, {"ended": "idle"})
    assert queue.get_job(engine, session.id).state == JobState.SUCCEEDED
    assert queue.admit(engine, GPU0, 60, ["playground", "train"], 0.1, 24.0).id == train.id
    third, reused = pg.open_session(engine, settings, user, "llama-8b")
    assert not reused and third.id != session.id

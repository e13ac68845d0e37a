"""The demo model ``stories260K``: registered by both processes at start (idempotent, no torch).

With ``settings.seed_dir`` set (a folder laid out like ``shared/data``) the model is converted
from ``<seed_dir>/models/stories260K/stories260K.bin`` and ``tok512.bin``; otherwise the worker
downloads those two files from the Hugging Face repo ``karpathy/tinyllamas`` on first use
(``source_ref`` is then ``hf://karpathy/tinyllamas/stories260K/stories260K.bin|...tok512.bin``).
"""
from __future__ import annotations

from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from app.settings import Settings
from app.store import repo
from app.store.schema import Model

DEMO_MODEL_NAME = "stories260K"
#: The demo model's fixed id, so two processes seeding at once register it once.
DEMO_MODEL_ID = "model-stories260K"
DEMO_HF_REPO = "karpathy/tinyllamas"
DEMO_HF_FILES = ("stories260K/stories260K.bin", "stories260K/tok512.bin")


def demo_source_ref(settings: Settings) -> str:
    """``<ckpt>|<tok>`` from the seed dir, or ``hf://repo/file`` references to download."""
    if settings.seed_dir:
        base = settings.seed_dir.resolve() / "models" / "stories260K"
        return f"{base / 'stories260K.bin'}|{base / 'tok512.bin'}"
    return "|".join(f"hf://{DEMO_HF_REPO}/{f}" for f in DEMO_HF_FILES)


def ensure_demo_model(engine: Engine, settings: Settings) -> Model:
    """Register ``stories260K`` (source ``llama2c``, shared: every user may train on it) and
    queue its import, unless it exists.

    Safe to call concurrently from the web and the worker: the fixed id :data:`DEMO_MODEL_ID`
    decides (a user's own model of the same name is another model). A previously failed import
    is queued again.
    """
    m = next((m for m in repo.models_named(engine, DEMO_MODEL_NAME) if m.shared), None)
    if m is None:
        try:
            return repo.add_model(engine, Model(id=DEMO_MODEL_ID, name=DEMO_MODEL_NAME,
                                                source="llama2c",
                                                source_ref=demo_source_ref(settings), shared=True))
        except IntegrityError:  # the other process registered it first
            return repo.get_model(engine, DEMO_MODEL_ID)
    if m.status == "failed":
        repo.update_model(engine, m.id, status="pending", error=None,
                          source_ref=demo_source_ref(settings))
        from app.store import queue

        queue.enqueue(engine, "import_model", {"spec_version": 1, "model_id": m.id}, priority=10)
        m = repo.get_model(engine, m.id)
    return m

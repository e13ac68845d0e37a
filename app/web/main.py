"""The web process: ``create_app(settings)`` and the ``whetstone-web`` console script.

The web process validates input, writes rows, renders pages and streams job events from the
database. It never imports torch, triton, transformers, whetstone_kernels or worker; the database is
its only channel to the worker.
"""
from __future__ import annotations

import gc
import logging
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from sqlalchemy import text

from app.settings import Settings, get_settings
from app.store import workers as workers_store
from app.store.db import get_engine, session_scope
from app.studio import worker_view
from app.web import docs, errors
from app.web.deps import get_engine as dep_engine

log = logging.getLogger("whetstone.web")

STATIC_DIR = Path(__file__).resolve().parents[2] / "static"


def _migration_head(engine) -> str | None:
    try:
        with session_scope(engine) as s:
            row = s.execute(text("SELECT version_num FROM alembic_version")).first()
            return row[0] if row else None
    except Exception:  # noqa: BLE001 - reported as not migrated
        return None


def _seed_demo_model(engine, settings: Settings) -> None:
    from app.store.seed import ensure_demo_model

    try:
        ensure_demo_model(engine, settings)
    except Exception:  # noqa: BLE001 - a seeding problem must not stop the studio
        log.exception("could not register the demo model")


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the FastAPI app for ``settings`` (default: from ``WHETSTONE_*`` variables).

    On startup the data dir is created, the database migrated to the newest schema and the
    demo model registered (when ``app.store.seed`` exists).
    """
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        from app.store import migrate

        settings.ensure_dirs()
        migrate.upgrade(settings.resolved_database_url)
        _seed_demo_model(app.state.engine, settings)
        yield

    # docs_url=None: app.web.docs serves /api/docs with Swagger UI from static/vendor (no CDN)
    app = FastAPI(title="Whetstone", version="0.1.0", lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url="/api/openapi.json")
    app.state.settings = settings
    app.state.engine = get_engine(settings.resolved_database_url)
    errors.install(app)
    docs.install(app)
    app.mount("/static", StaticFiles(directory=str(STATIC_DIR), check_dir=False), name="static")

    @app.get("/healthz")
    def healthz(request: Request) -> JSONResponse:
        """Public: ``{"status": "ok"|"degraded", "database": {"ok", "kind"}, "live_workers": n,
        "gpu_slots", "cpu_slots", "cpu_lanes", "reason"?}`` (what a HEALTHCHECK or a monitor
        needs; ``live_workers`` counts worker processes, not their slots and lanes:
        :func:`app.studio.worker_view.health`). A signed-in admin also gets the
        database's ``migration`` and ``error`` and the ``workers`` (host, pid, device, job, and
        ``role``: supervisor | gpu_slot | cpu_slot | cpu_lane | worker, ``group``: its process)."""
        engine = dep_engine(request)
        db = {"ok": False, "kind": engine.dialect.name, "migration": None}
        counts = worker_view.health([])
        try:
            with session_scope(engine) as s:
                s.execute(text("SELECT 1"))
            db["ok"] = True
            db["migration"] = _migration_head(engine)
            counts = worker_view.health(workers_store.live(engine, settings.worker_stale_seconds))
        except Exception as exc:  # noqa: BLE001
            db["error"] = str(exc)
        live = counts.pop("workers")
        body = {"status": "ok", "database": {"ok": db["ok"], "kind": db["kind"]}, **counts}
        if not db["ok"]:
            body.update(status="degraded", reason="the database is not reachable")
        elif not live:
            body.update(status="degraded", reason="no live worker: queued jobs wait until one "
                        "starts (python -m worker)")
        user = getattr(request.state, "user", None)
        if user is not None and user.role == "admin":  # host names, pids: not for everyone
            body.update(database=db, workers=live)
            if not db["ok"]:
                body["reason"] += f": {db.get('error')}"
        return JSONResponse(body, status_code=200)

    from app.web import auth
    from app.web.api import catalog, exports as api_exports, runs as api_runs
    from app.web.openai import files as openai_files, jobs as openai_jobs, models as openai_models
    from app.web.openai import chat as openai_chat
    from app.web.routes import (account, artifacts, datasets, exports, grpo, models, pages, runs)
    from app.web.routes import account_sessions
    from app.web.routes import gpus as gpu_routes, queue as queue_routes
    from app.web.routes import playground as playground_routes

    auth.install(app)
    from app.web.api import evaluations as api_evaluations
    from app.web.routes import evaluations as evaluation_routes

    app.include_router(api_evaluations.router)
    app.include_router(evaluation_routes.router)
    from app.web.api import compare as api_compare
    from app.web.routes import compare as compare_routes

    app.include_router(compare_routes.router)  # before the runs router: "compare" is no run id
    app.include_router(api_compare.router)
    for mod in (account, account_sessions, pages, datasets, models, runs, grpo, artifacts, exports, api_runs,
                catalog, api_exports, openai_files, openai_jobs, openai_models, queue_routes,
                gpu_routes, openai_chat, playground_routes):
        app.include_router(mod.router)
    return app


#: Seconds a stopping web process waits for open connections before it closes them.
SHUTDOWN_GRACE_SECONDS = 5


def server_config(app, settings: Settings, **overrides):
    """The ``uvicorn.Config`` that serves ``app``: ``settings.host:settings.port``; forwarded
    headers (``X-Forwarded-For``/``-Proto``) are trusted only from the proxies named by
    ``settings.forwarded_allow_ips`` (empty: from none, the client is the TCP peer).
    ``overrides`` go to ``uvicorn.Config`` as they are (e.g. ``port=0`` in tests). The access
    log writes any ``csrf_token`` in a URL as ``[redacted]``. On SIGTERM/SIGINT open connections
    (a run page's live stream, a streaming answer, a stalled upload) get
    :data:`SHUTDOWN_GRACE_SECONDS` to finish, then the process exits (uvicorn's default waits for
    them without limit, serving nothing meanwhile)."""
    import uvicorn

    proxies = settings.forwarded_allow_ips.strip()
    kwargs = dict(host=settings.host, port=settings.port, log_level="info",
                  proxy_headers=bool(proxies), forwarded_allow_ips=proxies or None,
                  timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS)
    config = uvicorn.Config(app, **{**kwargs, **overrides})  # configures uvicorn's loggers
    from app.web.csrf import redact_access_log

    redact_access_log()  # no CSRF token in an access line (app.web.csrf)
    return config


def run() -> None:
    """Console script ``whetstone-web``: serve on ``settings.host:settings.port`` with uvicorn."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = get_settings()
    server = uvicorn.Server(server_config(create_app(settings), settings))
    # everything imported and built so far (modules, routes, the app) lives as long as the
    # process: moved out of the collector's reach, full collections no longer walk it and pause
    # requests (~100 ms while an upload allocated). Only here, not in create_app: a process that
    # builds many apps (the tests) would keep their garbage.
    gc.collect()
    gc.freeze()
    server.run()


if __name__ == "__main__":
    run()

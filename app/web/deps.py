"""Request dependencies: the settings and database engine the app was created with."""
from __future__ import annotations

from fastapi import Request
from sqlalchemy.engine import Engine

from app.settings import Settings


def get_settings(request: Request) -> Settings:
    """The Settings passed to (or read by) :func:`app.web.main.create_app`."""
    return request.app.state.settings


def get_engine(request: Request) -> Engine:
    """The app's database engine (SQLite WAL or Postgres)."""
    return request.app.state.engine


def is_htmx(request: Request) -> bool:
    """True when the request was made by htmx (``HX-Request: true``)."""
    return request.headers.get("hx-request", "").lower() == "true"

"""Request dependencies: the settings and the database engine; the signed-in user
(``current_user``, ``CurrentUser``, ``AdminUser``) comes from :mod:`app.web.auth` and is
re-exported here, so routes import every dependency from one module."""
from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.engine import Engine

from app.settings import Settings
from app.web.auth import AdminUser, CurrentUser, current_user  # noqa: F401 - re-exported


def get_settings(request: Request) -> Settings:
    """The Settings passed to (or read by) :func:`app.web.main.create_app`."""
    return request.app.state.settings


def get_engine(request: Request) -> Engine:
    """The app's database engine (SQLite WAL or Postgres)."""
    return request.app.state.engine


def is_htmx(request: Request) -> bool:
    """True when the request was made by htmx (``HX-Request: true``)."""
    return request.headers.get("hx-request", "").lower() == "true"


EngineDep = Annotated[Engine, Depends(get_engine)]
SettingsDep = Annotated[Settings, Depends(get_settings)]

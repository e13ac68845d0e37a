"""Run notifications: a user's optional webhook URL, where the worker POSTs a run's end
(``worker/notify.py``: JSON with the run id, its state and metrics) when its training job
succeeds, fails or is cancelled."""
from __future__ import annotations

from urllib.parse import urlsplit

from sqlalchemy.engine import Engine

from app.store.db import session_scope
from app.store.schema import User
from app.studio import audit
from app.studio.errors import invalid

#: Longest webhook URL accepted (characters).
MAX_URL_CHARS = 2000


def check_webhook_url(url: str | None) -> str | None:
    """``url`` trimmed, or None when empty. Raises StudioError(invalid, ``webhook_url``) unless
    it is an absolute ``http``/``https`` URL with a host, no credentials, no whitespace or
    control characters, at most :data:`MAX_URL_CHARS` characters."""
    url = (url or "").strip()
    if not url:
        return None
    if len(url) > MAX_URL_CHARS:
        raise invalid("webhook_url", f"at most {MAX_URL_CHARS} characters")
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        raise invalid("webhook_url", "must not contain spaces or control characters")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - a port that is not a number raises here
    except ValueError as exc:
        raise invalid("webhook_url", f"not a valid URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise invalid("webhook_url", "must be an http:// or https:// URL with a host, e.g. "
                                     "https://hooks.example.com/whetstone")
    if parts.username or parts.password:
        raise invalid("webhook_url", "must not hold a user name or password; put a token in "
                                     "the path or query instead")
    return url


def set_webhook(engine: Engine, actor: User, url: str | None) -> User:
    """Set (or, with an empty ``url``, clear) the actor's own webhook URL; returns the user.

    Raises StudioError(invalid, ``webhook_url``): see :func:`check_webhook_url`."""
    url = check_webhook_url(url)
    with session_scope(engine, immediate=True) as s:
        user = s.get(User, actor.id)
        user.webhook_url = url
        s.add(user)
    audit.record(engine, actor.id, "account.webhook_set" if url else "account.webhook_cleared",
                 "user", actor.id)
    return user

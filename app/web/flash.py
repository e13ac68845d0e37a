"""One-time messages for the page a POST redirects to (POST-redirect-GET).

A form handler calls :func:`push` and answers 303 to its page; the page's next GET calls
:func:`pop` and shows what was pushed, once. Messages (a notice, or the plaintext of a new API
key) stay in this process's memory under a hash of the caller's sign-in (session cookie or
Bearer credential): never in a URL or a cookie. Unread ones expire after :data:`TTL` seconds.
"""
from __future__ import annotations

import hashlib
import threading
import time
from typing import Any

from fastapi import Request

from app.web import auth

TTL = 600.0
_MAX = 10_000  # signed-in callers with unread messages; the oldest go first past it


class FlashStore:
    """Unread messages per sign-in, oldest first, with an expiry."""

    def __init__(self) -> None:
        self._items: dict[str, tuple[float, list[dict[str, Any]]]] = {}
        self._lock = threading.Lock()

    def push(self, key: str, message: dict[str, Any]) -> None:
        """Keep ``message`` for ``key``'s next :meth:`pop`."""
        t = time.monotonic()
        with self._lock:
            for k in [k for k, (exp, _) in self._items.items() if exp <= t]:
                del self._items[k]
            while len(self._items) >= _MAX:
                del self._items[next(iter(self._items))]
            _, msgs = self._items.pop(key, (0.0, []))
            self._items[key] = (t + TTL, [*msgs, message])

    def pop(self, key: str) -> list[dict[str, Any]]:
        """``key``'s unread, unexpired messages (and forget them)."""
        with self._lock:
            exp, msgs = self._items.pop(key, (0.0, []))
        return msgs if exp > time.monotonic() else []


def _key(request: Request) -> str | None:
    cred = auth.current_token(request) or request.headers.get("authorization", "")
    user = getattr(request.state, "user", None)
    if not cred or user is None:
        return None
    return hashlib.sha256(f"{user.id}\0{cred}".encode()).hexdigest()


_CREATE = threading.Lock()


def _store(request: Request) -> FlashStore:
    state = request.app.state
    with _CREATE:
        if not hasattr(state, "flashes"):
            state.flashes = FlashStore()
    return state.flashes


def push(request: Request, **message: Any) -> None:
    """Keep ``message`` (keyword fields, e.g. ``notice="..."``) for the caller's next page."""
    key = _key(request)
    if key:
        _store(request).push(key, message)


def pop(request: Request) -> dict[str, Any]:
    """The caller's unread messages merged into one dict (later fields win), or ``{}``."""
    key = _key(request)
    merged: dict[str, Any] = {}
    for msg in _store(request).pop(key) if key else []:
        merged.update(msg)
    return merged

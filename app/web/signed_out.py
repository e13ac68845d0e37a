"""What a signed-out browser gets for a page request: where sign-in returns to, and the in-page
message htmx shows instead of navigating away from a half-filled form.

``return_to`` never names a fragment or POST endpoint: an htmx request returns to the page it was
sent from (``HX-Current-URL``), another unsafe request to its same-site ``Referer``.
"""
from __future__ import annotations

from html import escape
from urllib.parse import quote, urlsplit

from fastapi import Request
from fastapi.responses import Response

ALERT_ID = "session-alert"  # the slot in templates/base.html the message is swapped into


def _same_site_path(request: Request, url: str | None) -> str | None:
    """``path?query`` of ``url`` when it is on this studio's own host, else None."""
    if not url:
        return None
    parts = urlsplit(url)
    if parts.netloc.lower() != request.headers.get("host", "").lower() or \
            not parts.path.startswith("/") or parts.path.startswith("//"):
        return None
    return parts.path + (f"?{parts.query}" if parts.query else "")


def return_to(request: Request) -> str:
    """The page to show after sign-in: the page an htmx request came from, a GET page request's
    own URL, else (a form POST) the same-site page that sent it; ``/`` when none is known."""
    if request.headers.get("hx-request", "").lower() == "true":
        return _same_site_path(request, request.headers.get("hx-current-url")) or "/"
    if request.method in ("GET", "HEAD"):
        return request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return _same_site_path(request, request.headers.get("referer")) or "/"


def login_url(request: Request) -> str:
    """``/login?next=<return_to>``."""
    return f"/login?next={quote(return_to(request), safe='')}"


def htmx_response(request: Request) -> Response:
    """401 for an htmx request of a signed-out browser: a message swapped into the page's
    ``#session-alert`` slot (HX-Retarget/HX-Reswap/HX-Reselect), never a navigation, so the
    form the user is filling in stays as it is."""
    body = (f'<div id="signed-out" class="alert error" role="alert">You were signed out (in '
            f'another tab, or your session ended), so this was not sent. '
            f'<a href="{escape(login_url(request))}" target="_blank" rel="noopener">Sign in in '
            'another tab</a>, then retry here: this page keeps what you entered.</div>')
    return Response(body, status_code=401, media_type="text/html", headers={
        "HX-Retarget": f"#{ALERT_ID}", "HX-Reswap": "innerHTML", "HX-Reselect": "#signed-out"})

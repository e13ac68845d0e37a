"""Run notifications: a user's optional webhook URL, where the worker POSTs a run's end
(``worker/notify.py``: JSON with the run id, its state and metrics) when its training job
succeeds, fails or is cancelled.

Every surface sets it through :func:`set_webhook` (the account page, ``PUT /api/me/webhook``),
which validates the URL and makes the signing secret, shown to the user once. Deliveries are
signed the Standard Webhooks way (https://www.standardwebhooks.com): headers ``webhook-id``,
``webhook-timestamp`` (Unix seconds) and ``webhook-signature: v1,<base64 HMAC-SHA256>``, the
HMAC keyed with the base64-decoded part of the ``whsec_...`` secret, over
``"{webhook-id}.{webhook-timestamp}.{raw body}"`` (:func:`signature_headers`).

Against server-side request forgery a webhook may not point at an internal address: loopback,
private (10/8, 172.16/12, 192.168/16, fc00::/7), link-local (169.254/16, where cloud metadata
lives; fe80::/10), unspecified, shared, reserved or multicast (:func:`internal_reason`). The
host is checked when the URL is set and resolved again by the worker at each delivery (DNS can
change), unless the admin setting ``webhook_allow_private`` (``WHETSTONE_WEBHOOK_ALLOW_PRIVATE``)
allows internal receivers.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import secrets
import socket
import threading
from urllib.parse import urlsplit

from sqlalchemy.engine import Engine

from app.store.db import session_scope
from app.store.schema import User
from app.studio import audit
from app.studio.errors import invalid

#: Longest webhook URL accepted (characters).
MAX_URL_CHARS = 2000
#: The signing secret's prefix (Standard Webhooks); base64 of :data:`SECRET_BYTES` random bytes
#: follows it.
SECRET_PREFIX, SECRET_BYTES = "whsec_", 32
#: Seconds the web waits for a host name to resolve when a URL is set (the worker checks again).
RESOLVE_SECONDS = 2.0
#: What an admin sets to allow webhooks to internal addresses.
ALLOW_SETTING = "WHETSTONE_WEBHOOK_ALLOW_PRIVATE"
_LOCAL_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")


def internal_reason(address: str) -> str | None:
    """Why IP ``address`` (v4 or v6; an IPv4-mapped, 6to4 or Teredo v6 read as the v4 it
    carries) is internal —
    ``"loopback"``, ``"link-local"``, ``"private"``, ... — or None for a public address.
    Raises ValueError for a string that is not an IP address."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address):  # an IPv4 address carried inside an IPv6 one
        inner = ip.ipv4_mapped or ip.sixtofour or (ip.teredo or (None, None))[1]
        if inner is not None:
            ip = inner
    for attr, reason in (("is_unspecified", "unspecified"), ("is_loopback", "loopback"),
                         ("is_link_local", "link-local, where cloud metadata lives"),
                         ("is_multicast", "multicast"), ("is_reserved", "reserved")):
        if getattr(ip, attr):
            return reason
    if ip.is_private:
        return "private"
    if not ip.is_global:
        return "not a public address"
    return None


def resolve(host: str, port: int, timeout: float | None = None) -> list[str]:
    """The IP addresses ``host`` resolves to (TCP, ``port``), in resolver order, duplicates
    dropped; an IP literal is itself. ``timeout`` seconds at most when given (then ``[]`` when
    it takes longer). Raises OSError when the name does not resolve."""
    found: dict[str, list] = {}

    def lookup() -> None:
        try:
            found["infos"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            found["error"] = exc

    if timeout is None:
        lookup()
    else:
        t = threading.Thread(target=lookup, daemon=True, name="webhook-resolve")
        t.start()
        t.join(timeout)
    if "error" in found:
        raise found["error"]
    return list(dict.fromkeys(info[4][0] for info in found.get("infos", [])))


def internal_target(host: str, addresses: list[str]) -> str | None:
    """Why a webhook to ``host`` (resolved to ``addresses``) would reach an internal address,
    e.g. ``"localhost resolves to 127.0.0.1 (loopback)"``; None when every address is public."""
    name = host.strip("[]").rstrip(".").lower()
    if name in _LOCAL_NAMES or name.endswith(".localhost"):
        return f"{host} is this machine (loopback)"
    for addr in addresses:
        reason = internal_reason(addr)
        if reason is not None:
            same = addr == name
            return f"{host} is {reason}" if same else f"{host} resolves to {addr} ({reason})"
    return None


def check_webhook_url(url: str | None, allow_private: bool = False) -> str | None:
    """``url`` trimmed, or None when empty. Raises StudioError(invalid, ``webhook_url``) unless
    it is an absolute ``http``/``https`` URL with a host, no credentials, no whitespace or
    control characters, at most :data:`MAX_URL_CHARS` characters, whose host is not (and does
    not now resolve to) an internal address (:func:`internal_target`) — unless
    ``allow_private`` (the admin setting ``webhook_allow_private``). A name that does not
    resolve yet is accepted: the worker resolves it at each delivery."""
    url = (url or "").strip()
    if not url:
        return None
    if len(url) > MAX_URL_CHARS:
        raise invalid("webhook_url", f"at most {MAX_URL_CHARS} characters")
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        raise invalid("webhook_url", "must not contain spaces or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise invalid("webhook_url", f"not a valid URL ({exc})") from None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise invalid("webhook_url", "must be an absolute http:// or https:// URL with a host, "
                                     "e.g. https://hooks.example.com/whetstone")
    if "%" in parts.netloc:
        raise invalid("webhook_url", "must not hold % in its host (percent-encoding or an "
                                     "IPv6 zone); write the host plainly")
    if parts.username or parts.password:
        raise invalid("webhook_url", "must not hold a user name or password; put a token in "
                                     "the path or query instead")
    if not allow_private:
        try:
            addresses = resolve(parts.hostname, port or 443, RESOLVE_SECONDS)
        except (OSError, UnicodeError):
            addresses = []
        why = internal_target(parts.hostname, addresses)
        if why is not None:
            raise invalid("webhook_url", f"must not point at an internal address: {why}; "
                                         "webhooks go to public hosts (an admin may allow "
                                         f"internal ones with {ALLOW_SETTING})")
    return url


def new_secret() -> str:
    """A new signing secret: ``whsec_`` + base64 of :data:`SECRET_BYTES` random bytes."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def signature_headers(secret: str, msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The Standard Webhooks headers of one delivery: ``webhook-id`` (``msg_id``),
    ``webhook-timestamp`` (``timestamp``, Unix seconds) and ``webhook-signature``
    (``v1,`` + base64 HMAC-SHA256, keyed with the decoded ``secret``, of
    ``msg_id.timestamp.body``; ``body``: the exact bytes sent)."""
    key = base64.b64decode(secret.removeprefix(SECRET_PREFIX))
    signed = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(key, signed, hashlib.sha256).digest()
    return {"webhook-id": msg_id, "webhook-timestamp": str(timestamp),
            "webhook-signature": "v1," + base64.b64encode(digest).decode()}


def set_webhook(engine: Engine, actor: User, url: str | None,
                allow_private: bool = False) -> tuple[User, str | None]:
    """Set (or, with an empty ``url``, clear) the actor's own webhook URL. Setting it makes a
    new signing secret (the old one stops working), returned this once for the user to copy
    (it is kept server-side to sign, never shown again); clearing it drops the secret.
    ``allow_private``: the admin setting ``webhook_allow_private``.

    Returns (the user, the new secret or None when cleared).
    Raises StudioError(invalid, ``webhook_url``): see :func:`check_webhook_url`."""
    url = check_webhook_url(url, allow_private)
    secret = new_secret() if url else None
    with session_scope(engine, immediate=True) as s:
        user = s.get(User, actor.id)
        user.webhook_url, user.webhook_secret = url, secret
        s.add(user)
    audit.record(engine, actor.id, "account.webhook_set" if url else "account.webhook_cleared",
                 "user", actor.id)
    return user, secret

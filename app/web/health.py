"""``python -m app.web.health``: the web image's HEALTHCHECK. Asks this container's web process
for ``/healthz`` (``http://127.0.0.1:<WHETSTONE_PORT>``, with a ``Host`` header the process
serves: the first name of ``WHETSTONE_ALLOWED_HOSTS``, else ``127.0.0.1``) and exits 0 when it
answers and its database is reachable, else 1 with the reason on stderr. No worker is needed:
the web is healthy while it serves (``/healthz`` says "degraded" without a worker)."""
from __future__ import annotations

import json
import sys
import urllib.request

from app.settings import Settings

TIMEOUT_SECONDS = 5.0


def check(settings: Settings) -> tuple[bool, str]:
    """``(healthy, one line)`` from the local web process's ``/healthz`` (see the module)."""
    names = [h.strip() for h in settings.allowed_hosts.split(",") if h.strip() not in ("", "*")]
    req = urllib.request.Request(f"http://127.0.0.1:{settings.port}/healthz",
                                 headers={"Host": names[0] if names else "127.0.0.1"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_SECONDS) as resp:
            body = json.load(resp)
    except Exception as exc:  # noqa: BLE001 - refused, timed out, an error status, not JSON
        return False, f"web: /healthz did not answer: {' '.join(str(exc).split())[:300]}"
    db = body.get("database") or {}
    if not db.get("ok"):
        return False, "web: the database is not reachable (details: /healthz as an admin)"
    return True, f"web: {body.get('status')} (database {db.get('kind')}, " \
                 f"{body.get('live_workers', 0)} live workers)"


def main() -> int:
    """Print the check's line (stdout healthy, stderr not); returns 0 healthy, 1 not."""
    ok, line = check(Settings())
    print(line, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

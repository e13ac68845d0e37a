"""``python -m worker --health``: the worker image's HEALTHCHECK. Exits 0 when the supervisor's
own worker row (id ``--worker-id``, default this host's name, as ``--supervise`` registers it)
was refreshed within ``settings.worker_stale_seconds``, else 1 with the reason on stderr (no
row, a stale heartbeat, the database unreachable). Reads only; imports neither torch nor NVML."""
from __future__ import annotations

import socket
import sys

from app.settings import Settings


def check(settings: Settings, worker_id: str | None = None) -> tuple[bool, str]:
    """``(healthy, one line)`` for the worker row ``worker_id`` (default: the host name): healthy
    when its ``last_seen`` is at most ``settings.worker_stale_seconds`` seconds old."""
    from app.store.db import make_engine, session_scope
    from app.store.schema import Worker, now

    wid = worker_id or socket.gethostname()
    engine = make_engine(settings.resolved_database_url)
    try:
        with session_scope(engine) as s:
            row = s.get(Worker, wid)
            age = None if row is None else now() - row.last_seen
    except Exception as exc:  # noqa: BLE001 - unhealthy, with the reason
        return False, f"worker {wid}: the database is not reachable: {' '.join(str(exc).split())[:300]}"
    finally:
        engine.dispose()
    if age is None:
        return False, f"worker {wid}: no heartbeat row (not started, or stopped)"
    if age > settings.worker_stale_seconds:
        return False, (f"worker {wid}: last heartbeat {age:.0f} s ago "
                       f"(stale after {settings.worker_stale_seconds:g} s)")
    return True, f"worker {wid}: heartbeat {age:.1f} s ago"


def main(worker_id: str | None = None) -> int:
    """Print the check's line (stdout when healthy, stderr when not); returns the exit status
    (0 healthy, 1 not)."""
    ok, line = check(Settings(), worker_id)
    print(line, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1

"""The one rule for a list's ``limit`` query parameter, on every surface (``/api/runs``,
``/api/playground/sessions``, ``/v1/files``, ``/v1/fine_tuning/jobs`` and a job's events and
checkpoints): absent or empty means the list's default; otherwise a whole number from 1 to the
list's most, or the request is refused naming ``limit`` (422 under ``/api``, 400 under ``/v1``,
as every ``invalid`` StudioError). Nothing is clamped silently: ``-1`` is not "1", and ``5000``
is not "the most". ``order`` (``/v1/files``) is "asc" or "desc", else refused naming ``order``."""
from __future__ import annotations

from app.studio.errors import StudioError, whole


def page_limit(value: object, default: int, most: int) -> int:
    """How many items a list answers: ``default`` when ``value`` (the raw query parameter,
    text or a number) is None or blank, else ``value`` as a whole number from 1 to ``most``.

    Raises:
        StudioError: invalid (field ``limit``, code ``invalid_value``) for anything else: 0, a
            negative number, more than ``most``, ``2.5``, ``abc``.
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return default
    n = whole(value)
    if n is not None and 1 <= n <= most:
        return n
    shown = str(value)
    shown = shown if len(shown) <= 24 else shown[:21] + "..."
    raise StudioError("invalid", f"limit must be a whole number from 1 to {most} (default "
                                 f"{default}), not {shown!r}", "limit", "invalid_value")


def after_cursor(items: list, ids: list[str], after: str | None, what: str) -> list:
    """``items`` (with their ``ids``, in list order) after the one whose id is ``after`` (an
    OpenAI-style cursor); all of them when ``after`` is None or blank.

    Raises:
        StudioError: not_found (field ``after``) when no listed item has that id (a deleted or
            another user's object): a client paging on must not silently start over.
    """
    if after is None or not after.strip():
        return items
    if after not in ids:
        raise StudioError("not_found", f"after: no {what} with id {after!r} to list after",
                          "after")
    return items[ids.index(after) + 1:]


def page_order(value: str | None, default: str = "desc") -> str:
    """A list's ``order`` query parameter: "asc" or "desc" (``default`` when absent or blank).

    Raises:
        StudioError: invalid (field ``order``, code ``invalid_value``) for any other value.
    """
    if value is None or not value.strip():
        return default
    if value in ("asc", "desc"):
        return value
    shown = value if len(value) <= 24 else value[:21] + "..."
    raise StudioError("invalid", f"order must be 'asc' or 'desc', not {shown!r}", "order",
                      "invalid_value")

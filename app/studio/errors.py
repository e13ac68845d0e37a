"""The one error type of the use-case layer: a kind, a message and (for bad input) a field.

Surfaces map the kind to HTTP once each (``app.web.errors``): ``not_found`` -> 404 (also for
another user's object, so ids do not leak), ``invalid`` -> 422 (400 under ``/v1``),
``unauthorized`` -> 401, ``forbidden`` -> 403, ``conflict`` -> 409, ``too_many`` -> 429,
``unavailable`` -> 503.
"""
from __future__ import annotations

from collections.abc import Iterable

KINDS = ("not_found", "invalid", "unauthorized", "forbidden", "conflict", "too_many", "unavailable")


class StudioError(Exception):
    """A use case refused: ``kind`` (one of :data:`KINDS`), ``message`` for the user, the
    request ``field`` it is about (None when it concerns the request as a whole), and an
    optional machine-readable ``code`` (e.g. ``model_in_use``) that surfaces pass on.

    Raises:
        ValueError: ``kind`` is not one of :data:`KINDS` (a programming error).
    """

    def __init__(self, kind: str, message: str, field: str | None = None,
                 code: str | None = None):
        if kind not in KINDS:
            raise ValueError(f"unknown StudioError kind {kind!r}")
        super().__init__(f"{field}: {message}" if field else message)
        self.kind, self.message, self.field, self.code = kind, message, field, code


def not_found(what: str, ident: object) -> StudioError:
    """``StudioError("not_found")`` phrased as ``no <what> with id '<ident>'``; used for missing
    objects and for objects the caller may not see alike."""
    return StudioError("not_found", f"no {what} with id {ident!r}")


def invalid(field: str | None, message: str) -> StudioError:
    """``StudioError("invalid")`` about ``field``."""
    return StudioError("invalid", message, field)


class FieldErrors(StudioError):
    """Several bad fields of one form or spec at once (kind ``invalid``): ``fields`` maps each
    field to its message, in form order; the first is the error's ``field`` and ``message``.
    ``general``: messages about no one field (with no field, the first is the message; else
    :attr:`FALLBACK`)."""

    FALLBACK = "invalid input"

    def __init__(self, fields: dict[str, str], general: list[str] | None = None):
        field, message = next(iter(fields.items()), (None, (general or [self.FALLBACK])[0]))
        super().__init__("invalid", message, field)
        self.fields, self.general = dict(fields), list(general or [])


def field_messages(exc: StudioError, default: str | None = "form") -> dict[str | None, str]:
    """``{field: message}`` of ``exc`` for a form: every field of a :class:`FieldErrors`, else
    its one field (``default`` when it names none)."""
    if isinstance(exc, FieldErrors) and exc.fields:
        return dict(exc.fields)
    return {exc.field or default: exc.message}


def collect(*checks) -> list:
    """Run every zero-argument ``check`` and raise one :class:`FieldErrors` with each field's
    first complaint (so a form shows all its bad fields at once); when all pass, what each
    returned, in order. StudioErrors of other kinds, or without a field, propagate as raised."""
    found: dict[str, str] = {}
    results = []
    for check in checks:
        try:
            results.append(check())
        except StudioError as exc:
            if exc.kind != "invalid" or exc.field is None:
                raise
            for field, message in field_messages(exc).items():
                found.setdefault(field, message)
    if found:
        raise FieldErrors(found)
    return results


def whole(value: object) -> int | None:
    """``value`` as a whole number: an int, a float without a fraction, or text of ASCII digits
    (an optional sign, surrounding blanks); None for anything else: a bool, ``2.5``, inf, NaN,
    ``"²"``, or a number of 19 digits or more (no step or count is that large, and int() refuses
    text of over 4300 digits)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float):
        return int(value) if value.is_integer() and abs(value) < 1e18 else None
    if isinstance(value, int):
        return value if abs(value) < 10**18 else None
    if isinstance(value, str):
        text = value.strip()
        digits = text[1:] if text[:1] in "+-" else text
        if digits.isascii() and digits.isdigit() and len(digits) <= 18:
            return int(text)
    return None


def said_once(refusal: str | None, shown: Iterable[str | None]) -> str | None:
    """The refusal of a click to show above a page's controls: ``refusal``, or None when the
    page already shows that very sentence (``shown``: the reasons it prints beside its disabled
    controls, e.g. "Cannot resume: ..."), so that a user reads it once, not twice."""
    if refusal is None or refusal in {s for s in shown if s}:
        return None
    return refusal

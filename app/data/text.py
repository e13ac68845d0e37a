"""Text that tokenizers can take: no unpaired UTF-16 surrogate.

JSON's ``\\ud800``-style escapes can spell half of a surrogate pair; Python decodes it into a str
that is not valid Unicode text (it cannot be encoded as UTF-8), and a tokenizer refuses it with a
``TypeError`` deep inside (trial s24: a chat message with ``\\ud800`` ended the playground session
with that error; a dataset row with one failed the whole validation). Rows and messages are
checked here first, so the refusal names the row or message and the character.
"""
from __future__ import annotations

from typing import Any


def surrogate_at(s: str) -> int | None:
    """Index of the first unpaired surrogate in ``s``, or None when ``s`` is valid text."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def describe(s: str, at: int) -> str:
    """'an unpaired UTF-16 surrogate (\\ud800) at character 3': what is wrong, for a message."""
    return f"an unpaired UTF-16 surrogate (\\u{ord(s[at]):04x}) at character {at + 1}"


def find_surrogate(value: Any, path: str = "") -> tuple[str, str] | None:
    """(field path, :func:`describe` text) of the first string inside ``value`` (str, or dicts
    and lists of them, as a parsed JSON row) holding an unpaired surrogate; None when all are
    valid text. Paths read ``messages[1].content``."""
    if isinstance(value, str):
        at = surrogate_at(value)
        return None if at is None else (path, describe(value, at))
    if isinstance(value, dict):
        for k, v in value.items():
            got = find_surrogate(v, f"{path}.{k}" if path else str(k))
            if got is not None:
                return got
    elif isinstance(value, list):
        for i, v in enumerate(value):
            got = find_surrogate(v, f"{path}[{i}]")
            if got is not None:
                return got
    return None

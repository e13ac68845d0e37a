"""The checked parts of a playground prompt: sampling parameters and chat messages, as the
playground API (:mod:`app.studio.playground`) and ``/v1/chat/completions`` accept them. Pure
functions: no store, no session."""
from __future__ import annotations

import math
from typing import Any

from app.data.text import describe, surrogate_at
from app.studio.errors import invalid

ROLES = ("system", "user", "assistant")
#: Longest answer a prompt may ask for (tokens) and the default.
MAX_TOKENS, DEFAULT_MAX_TOKENS = 8192, 256


def _shown(given: Any, value: float) -> str:
    """A refused number as the caller gave it: ``1000000000``, not ``1e+09``."""
    if isinstance(given, int) and not isinstance(given, bool):
        return str(given)
    if isinstance(given, str) and len(given.strip()) <= 40:
        return given.strip()
    return _g(value)


def _g(x: float) -> str:
    """A number as written: ``1000000``, ``0.5`` (not ``1e+06``; ``:g`` from 1e18 on)."""
    x = float(x)
    return str(int(x)) if x.is_integer() and abs(x) < 1e18 else f"{x:g}"


def _number(value: Any, name: str, default: float, lo: float, hi: float,
            lo_open: bool = False, hi_open: bool = False) -> float:
    if value is None:
        return default
    given = value
    low = f"greater than {_g(lo)}" if lo_open else f"at least {_g(lo)}"
    high = f"less than {_g(hi)}" if hi_open else f"at most {_g(hi)}"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**63:
        # an integer too large for a float (JSON allows 10**400): outside every range here
        raise invalid(name, f"must be {low} and {high}, not a number of "
                            f"{len(str(abs(value)))} digits")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        try:
            value = float(str(value).strip())
        except ValueError:
            raise invalid(name, f"must be a number, not {value!r}") from None
    if not math.isfinite(value):
        raise invalid(name, f"must be a finite number, not {value!r}")
    if value < lo or (lo_open and value == lo) or value > hi or (hi_open and value == hi):
        raise invalid(name, f"must be {low} and {high}, not {_shown(given, value)}")
    return float(value)


#: The samplers a prompt may switch on, off by default, with the value that means off: HF's
#: ``top_k`` (an integer >= 0), ``min_p`` in [0, 1), ``repetition_penalty`` in (0, 10].
EXTRA_OFF = {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
#: Largest repetition penalty and top_k a prompt may ask for (a top_k over the vocabulary is off).
MAX_REPETITION_PENALTY, MAX_TOP_K = 10.0, 1_000_000
#: What :func:`params` uses for a field the prompt leaves out (the Playground form starts there).
DEFAULTS = {"temperature": 0.7, "top_p": 1.0, "max_tokens": DEFAULT_MAX_TOKENS, **EXTRA_OFF}
#: The upper bounds of the form's number fields, as :func:`params` checks them.
LIMITS = {"max_tokens": MAX_TOKENS, "top_k": MAX_TOP_K,
          "repetition_penalty": MAX_REPETITION_PENALTY}


def _whole(value: Any, name: str, default: float, lo: float, hi: float) -> int:
    v = _number(value, name, default, lo, hi)
    if v != int(v):
        raise invalid(name, f"must be a whole number, not {v:g}")
    return int(v)


def params(temperature: Any = None, top_p: Any = None, max_tokens: Any = None,
           seed: Any = None, top_k: Any = None, min_p: Any = None,
           repetition_penalty: Any = None) -> dict[str, Any]:
    """Validated sampling parameters: ``temperature`` in [0, 2] (0: greedy; default 0.7),
    ``top_p`` in (0, 1] (default 1), ``max_tokens`` an integer in [1, :data:`MAX_TOKENS`]
    (default :data:`DEFAULT_MAX_TOKENS`), ``seed`` an integer or None; and, in the result only
    when switched on (see :data:`EXTRA_OFF`): ``top_k`` an integer >= 0 (0: off),
    ``min_p`` in [0, 1) (0: off), ``repetition_penalty`` in (0, 10] (1: off; HF's: a logit of a
    token already in the prompt or the answer is divided by it, a negative one multiplied).
    Raises StudioError invalid naming the field."""
    d = DEFAULTS
    out: dict[str, Any] = {
        "temperature": _number(temperature, "temperature", d["temperature"], 0.0, 2.0),
        "top_p": _number(top_p, "top_p", d["top_p"], 0.0, 1.0, lo_open=True)}
    out["max_tokens"] = _whole(max_tokens, "max_tokens", d["max_tokens"], 1, MAX_TOKENS)
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
            raise invalid("seed", "must be an integer from 0 to 2147483647")
        out["seed"] = seed
    k = _whole(top_k, "top_k", d["top_k"], 0, MAX_TOP_K)
    mp = _number(min_p, "min_p", d["min_p"], 0.0, 1.0, hi_open=True)
    rp = _number(repetition_penalty, "repetition_penalty", d["repetition_penalty"], 0.0,
                 MAX_REPETITION_PENALTY, lo_open=True)
    for name, value in (("top_k", k), ("min_p", mp), ("repetition_penalty", rp)):
        if value != EXTRA_OFF[name]:
            out[name] = value
    return out


#: The sampling fields of a prompt body, in :func:`params`' order.
FIELDS = ("temperature", "top_p", "max_tokens", "seed", "top_k", "min_p", "repetition_penalty")


def prompt_params(body: dict[str, Any]) -> dict[str, Any]:
    """The checked :func:`params` of a prompt body (its :data:`FIELDS`). Raises StudioError
    invalid naming the field (``body`` not an object too)."""
    if not isinstance(body, dict):
        raise invalid("prompt", "must be an object")
    return params(*(body.get(name) for name in FIELDS))


def messages(value: Any, name: str = "messages", system: str | None = None) -> list[dict]:
    """``[{"role", "content"}]`` checked: a non-empty list, roles system/user/assistant, text
    content (OpenAI ``[{"type": "text", "text"}]`` parts are joined), the last one the user's;
    ``system`` (when given and the list has none) is put first. Raises StudioError invalid."""
    if not isinstance(value, list) or not value:
        raise invalid(name, "must be a non-empty list of {role, content} messages")
    out = []
    for i, m in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise invalid(f"{where}.role", f"must be one of {', '.join(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):
            parts = [p.get("text") for p in content if isinstance(p, dict)]
            if not all(isinstance(p, str) for p in parts) or len(parts) != len(content):
                raise invalid(f"{where}.content", "only text content parts are supported")
            content = "".join(parts)
        if not isinstance(content, str):
            raise invalid(f"{where}.content", "must be a string")
        if (at := surrogate_at(content)) is not None:
            raise invalid(f"{where}.content", f"has {describe(content, at)}: not text")
        out.append({"role": m["role"], "content": content})
    if out[-1]["role"] != "user":
        raise invalid(name, "the last message must be the user's")
    if system and (at := surrogate_at(system)) is not None:
        raise invalid("system", f"has {describe(system, at)}: not text")
    if system and system.strip() and out[0]["role"] != "system":
        out.insert(0, {"role": "system", "content": system.strip()})
    return out

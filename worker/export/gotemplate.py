"""Emit an Ollama ``TEMPLATE`` (Go ``text/template``) from a :class:`ChatLayout`, and evaluate
the subset of Go template syntax that we emit, to check the result against the Jinja template.

Ollama executes the TEMPLATE with ``.System`` (all system messages joined by ``"\\n\\n"``) and
``.Messages`` (consecutive messages of one role merged with ``"\\n\\n"``; system messages stay
in the list), each with ``.Role`` and ``.Content`` (ollama ``template/template.go``, ``collate``).
The llama.cpp runner adds BOS itself when the GGUF says ``add_bos_token``, so a leading BOS
text of the Jinja template is left out of the TEMPLATE.

Evaluator subset (Go ``text/template`` semantics): text; ``{{-``/``-}}`` whitespace trimming;
``if``/``else if``/``else``/``end``; ``range $i, $_ := pipeline``; ``$x := v`` and ``$x = v``;
fields ``.A``, ``$.A``, ``$x``; string/bool literals; ``eq``, ``not``, ``and``, ``or``, ``len``,
``slice`` and parentheses. Truthiness follows Go: empty string/list, false, nil are false.
It is our own small interpreter, not Go's; anything outside the subset raises ``ValueError``.
"""
from __future__ import annotations

import json
import re

from .chat import ChatLayout


def _lit(text: str) -> str:
    """Template text for a literal; quoted as a Go string if it could be read as an action."""
    if not text:
        return ""
    if "{{" in text or "}}" in text or text.endswith("{") or text.startswith("}"):
        return "{{ " + json.dumps(text, ensure_ascii=False) + " }}"
    return text


def go_template(lay: ChatLayout, bos_text: str = "") -> str:
    """The TEMPLATE text; ``bos_text`` is stripped from the start of the head pieces."""
    strip = lambda s: s[len(bos_text):] if bos_text and s.startswith(bos_text) else s  # noqa
    sysblock = _lit(lay.sys_head) + "{{ $.System }}" + _lit(lay.sys_post)
    if lay.system_mode == "block":
        out = ("{{ if .System }}" + _lit(strip(lay.sys_head)) + "{{ .System }}" +
               _lit(lay.sys_post) + "{{ else }}" + _lit(strip(lay.head)) + "{{ end }}")
    else:
        out = _lit(strip(lay.head))
    inject = ""
    if lay.system_mode in ("first_user", "merged"):
        out += "{{ $first := true }}"
        inject = "{{ if and $.System $first }}" + sysblock + "{{ end }}{{ $first = false }}"
    elif lay.system_mode == "last_user":
        inject = "{{ if and $.System $last }}" + sysblock + "{{ end }}"
    out += ("{{ range $i, $_ := .Messages }}{{ $last := eq (len (slice $.Messages $i)) 1 }}"
            '{{ if eq .Role "user" }}' + _lit(lay.user_pre) + inject + "{{ .Content }}" +
            _lit(lay.user_post) + "{{ if $last }}" + _lit(lay.gen) + "{{ end }}"
            '{{ else if eq .Role "assistant" }}' + _lit(lay.asst_pre) + "{{ .Content }}" +
            "{{ if not $last }}" + _lit(lay.asst_post) + "{{ end }}{{ end }}{{ end }}")
    return out


def ollama_values(messages: list[dict]) -> dict:
    """The data Ollama gives the template for a chat request (its ``collate``)."""
    system, merged = [], []
    for m in messages:
        if m["role"] == "system":
            system.append(m["content"])
        if merged and merged[-1]["Role"] == m["role"]:
            merged[-1]["Content"] += "\n\n" + m["content"]
        else:
            merged.append({"Role": m["role"], "Content": m["content"]})
    return {"System": "\n\n".join(system), "Messages": merged}


# ---------------------------------------------------------------------------- evaluator
_ACTION = re.compile(r"\{\{(-\s)?(.*?)(\s-)?\}\}", re.S)
_TOKEN = re.compile(r'\s*("(?:[^"\\]|\\.)*"|\(|\)|:=|=|,|\$?[.\w]*\w|\$\.\w+|\$|\.)')


def _lex(src: str) -> list:
    """Split into ``("text", s)`` and ``("act", s)`` items, applying trim markers."""
    items, pos = [], 0
    for m in _ACTION.finditer(src):
        text = src[pos:m.start()]
        if m.group(1):
            text = text.rstrip(" \t\r\n")
        items.append(["text", text])
        items.append(["act", m.group(2).strip(), bool(m.group(3))])
        pos = m.end()
    items.append(["text", src[pos:]])
    for k, it in enumerate(items):
        if it[0] == "act" and it[2] and k + 1 < len(items):
            items[k + 1][1] = items[k + 1][1].lstrip(" \t\r\n")
    return items


def _words(act: str) -> list[str]:
    out, pos = [], 0
    act = act.strip()
    while pos < len(act):
        m = _TOKEN.match(act, pos)
        if not m or m.end() == pos:
            raise ValueError(f"unsupported template action: {act!r}")
        out.append(m.group(1))
        pos = m.end()
    return out


def _truthy(v) -> bool:
    return bool(v) if v is not None else False


class _Eval:
    FUNCS = {
        "eq": lambda a, *b: any(a == x for x in b),
        "not": lambda a: not _truthy(a),
        "and": lambda *a: next((x for x in a if not _truthy(x)), a[-1]),
        "or": lambda *a: next((x for x in a if _truthy(x)), a[-1]),
        "len": len,
        "slice": lambda x, *ij: x[ij[0]:ij[1]] if len(ij) > 1 else x[ij[0]:] if ij else x,
    }

    def __init__(self, items: list, root: dict):
        self.items, self.root, self.out = items, root, []

    def value(self, w: str, dot, scope: list[dict]):
        if w.startswith('"'):
            return json.loads(w)
        if w in ("true", "false"):
            return w == "true"
        if w.lstrip("-").isdigit():
            return int(w)
        if w == ".":
            return dot
        if w.startswith("$."):
            return self.root[w[2:]]
        if w == "$":
            return self.root
        if w.startswith("$"):
            for s in reversed(scope):
                if w in s:
                    return s[w]
            raise ValueError(f"undefined variable {w}")
        if w.startswith("."):
            return dot[w[1:]]
        raise ValueError(f"unsupported word {w!r}")

    def expr(self, ws: list[str], dot, scope):
        """Evaluate a command: a function call or a single operand (parentheses nest)."""
        args, k = [], 0
        while k < len(ws):
            if ws[k] == "(":
                depth, j = 1, k + 1
                while depth:
                    depth += {"(": 1, ")": -1}.get(ws[j], 0)
                    j += 1
                args.append(("v", self.expr(ws[k + 1:j - 1], dot, scope)))
                k = j
            else:
                args.append(("w", ws[k]))
                k += 1
        if args[0][0] == "w" and args[0][1] in self.FUNCS:
            vals = [a[1] if a[0] == "v" else self.value(a[1], dot, scope) for a in args[1:]]
            return self.FUNCS[args[0][1]](*vals)
        if len(args) != 1:
            raise ValueError(f"unsupported command {ws}")
        return args[0][1] if args[0][0] == "v" else self.value(args[0][1], dot, scope)

    def block(self, k: int, dot, scope: list[dict], run: bool) -> tuple[int, str]:
        """Run items from ``k`` until an else/end at this level; returns (index, stopper)."""
        while k < len(self.items):
            it = self.items[k]
            if it[0] == "text":
                if run:
                    self.out.append(it[1])
                k += 1
                continue
            ws = _words(it[1])
            head = ws[0] if ws else ""
            if head in ("end", "else"):
                return k, it[1]
            if head == "if":
                k = self._if(k, ws[1:], dot, scope, run)
            elif head == "range":
                k = self._range(k, ws[1:], dot, scope, run)
            elif len(ws) > 2 and ws[1] in (":=", "="):
                if run:
                    v = self.expr(ws[2:], dot, scope)
                    if ws[1] == ":=":
                        scope[-1][ws[0]] = v
                    else:
                        next(s for s in reversed(scope) if ws[0] in s)[ws[0]] = v
                k += 1
            else:
                if run:
                    v = self.expr(ws, dot, scope)
                    self.out.append("" if v is None else str(v))
                k += 1
        return k, ""

    def _if(self, k, cond, dot, scope, run) -> int:
        taken = False
        while True:
            ok = run and not taken and _truthy(self.expr(cond, dot, scope))
            scope.append({})
            k, stop = self.block(k + 1, dot, scope, ok)
            scope.pop()
            taken = taken or ok
            if stop == "end":
                return k + 1
            ws = _words(stop)
            if ws[:2] == ["else", "if"]:
                cond = ws[2:]
            elif ws == ["else"]:
                cond = ["true"]
            else:
                raise ValueError(f"unterminated if (got {stop!r})")

    def _range(self, k, ws, dot, scope, run) -> int:
        if len(ws) < 5 or ws[1] != "," or ws[3] != ":=":
            raise ValueError("only `range $i, $x := pipeline` is supported")
        seq = self.expr(ws[4:], dot, scope) if run else []
        end = None
        for i, el in enumerate(seq or []):
            scope.append({ws[0]: i, ws[2]: el})
            end, stop = self.block(k + 1, el, scope, True)
            scope.pop()
        scope.append({})
        skip, stop = self.block(k + 1, dot, scope, False)
        scope.pop()
        if stop != "end":
            raise ValueError("range without end")
        return (end if end is not None else skip) + 1


def execute(template: str, values: dict) -> str:
    """Execute ``template`` (the supported subset) on ``values``; raises ``ValueError``."""
    ev = _Eval(_lex(template), values)
    k, stop = ev.block(0, values, [{}], True)
    if stop:
        raise ValueError(f"unexpected {{{{{stop}}}}}")
    return "".join(ev.out)

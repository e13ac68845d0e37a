"""Detect a dataset's format and normalise each row to a canonical example.

Canonical examples are plain JSON-serialisable dicts, one of:

* ``{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...],
  "tools": [...]?}`` — a conversation; it starts with an optional system message, then a
  user turn, and ends with an assistant turn.  ``tools`` (optional) holds OpenAI-style
  function specs ``{"type": "function", "function": {...}}`` passed to the chat template.
* ``{"text": str}`` — plain text (continued pre-training): every token is trained.
* ``{"prompt": str, "completion": str}`` — TRL's *standard* prompt/completion: the two
  strings are concatenated verbatim (no chat template) and only the completion is trained.

Formats (``FORMATS``):

* ``alpaca``: instruction / input / output (optional ``system``, ``history`` [[q, a], ...]);
  the user turn is ``instruction`` + blank line + ``input`` (when non-empty).
* ``sharegpt``: ``conversations`` of ``{"from", "value"}``; roles human/user → user,
  gpt/assistant/model → assistant, system → system, function_call → assistant (its value,
  the call's JSON, is what the model must learn to emit), observation/tool/function → tool.
  Optional ``system`` column; ``tools`` may be a JSON *string* (as in glaive) or a list.
* ``messages``: OpenAI chat ``messages`` of ``{"role", "content"}`` (content may also be a
  list of ``{"type": "text", "text"}`` parts).
* ``prompt_completion``: ``prompt`` plus ``completion`` (or ``answer``/``response``).  A
  trailing literal ``###eos_token###`` marker is stripped (the real EOS token is appended
  at encoding) and reported as a warning; a prompt that already holds an instruction
  template is reported as a warning too (it is used verbatim, so never templated twice).
* ``text``: a ``text`` column, or any .txt file.
* ``oasst_tree``: raw OpenAssistant trees (``prompt`` with nested ``replies``): from the root
  the non-deleted, human-written, best-ranked reply is followed to a leaf, and the path is
  trimmed to end on an assistant turn; synthetic trees are rejected per row.

Per-row problems raise :class:`DatasetError` with the row and the field path in the file's
own names (e.g. ``conversations[1].value``); callers collect them instead of aborting.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any, Iterable

from .errors import DatasetError, RowIssue
from .text import find_surrogate

FORMATS = ("alpaca", "sharegpt", "messages", "prompt_completion", "text", "oasst_tree")
FORMAT_ALIASES = {"openai": "messages", "chatml": "messages", "conversations": "sharegpt",
                  "completion": "prompt_completion", "prompt-completion": "prompt_completion",
                  "plain": "text", "plain_text": "text", "pretrain": "text"}
COMPLETION_KEYS = ("completion", "answer", "response")
CONV_KEYS = ("conversations", "conversation", "messages")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "model": "assistant", "chatgpt": "assistant", "bard": "assistant",
                  "system": "system", "function_call": "assistant", "observation": "tool",
                  "tool": "tool", "function": "tool", "ipython": "tool"}
MESSAGE_ROLES = {"system": "system", "developer": "system", "user": "user",
                 "assistant": "assistant", "tool": "tool", "function": "tool", "ipython": "tool"}
EOS_MARKER_RE = re.compile(r"\s*#{2,}\s*eos_token\s*#{2,}\s*$", re.IGNORECASE)
PRETEMPLATE_MARKERS = ("### Instruction:", "### Response:", "<|im_start|>", "[INST]",
                       "<|start_header_id|>", "<start_of_turn>", "<|user|>")


def canonical_format(fmt: str) -> str:
    """Validate a user-given format name (aliases accepted). Raises DatasetError."""
    name = fmt.strip().lower().replace(" ", "_")
    name = FORMAT_ALIASES.get(name, name)
    if name not in FORMATS:
        raise DatasetError(f"unknown dataset format {fmt!r}; choose one of {', '.join(FORMATS)}")
    return name


#: Formats whose rows train as plain text (the tokenizer's special tokens added), not as chat
#: renderings of the run's template (:attr:`app.data.encode.Prepared.add_special_tokens`).
PLAIN_FORMATS = ("prompt_completion", "text")


def is_chat_format(fmt: str) -> bool:
    """Whether rows of dataset format ``fmt`` (a detected or given name, aliases accepted; GRPO's
    ``prompts`` too) train as chat renderings of the template."""
    name = FORMAT_ALIASES.get(fmt.strip().lower().replace(" ", "_"), fmt.strip().lower())
    return name not in PLAIN_FORMATS


#: Columns that mark a row as KTO data: an answer plus a desirable/undesirable flag (TRL's
#: ``label``, LLaMA-Factory's ``kto_tag``), which supervised training must not learn from.
KTO_FLAGS = ("label", "kto_tag")


def row_signature(data: dict) -> str | None:
    """The format one row looks like, or None (``preference`` and ``kto`` are recognised so that
    they can be refused with the reason)."""
    if "chosen" in data and "rejected" in data:
        return "preference"
    if any(isinstance(data.get(k), bool) for k in KTO_FLAGS):
        return "kto"
    for key in CONV_KEYS:
        conv = data.get(key)
        if isinstance(conv, list) and conv:
            turn = next((t for t in conv if isinstance(t, dict)), None)
            if turn is not None:
                if "from" in turn or "value" in turn:
                    return "sharegpt"
                if "role" in turn or "content" in turn:
                    return "messages"
    if "instruction" in data and "output" in data:
        return "alpaca"
    if isinstance(data.get("prompt"), dict) and "replies" in data["prompt"]:
        return "oasst_tree"
    if "prompt" in data and any(k in data for k in COMPLETION_KEYS):
        return "prompt_completion"
    if "text" in data:
        return "text"
    return None


def detect_format(rows: Iterable[dict]) -> str:
    """Detect the format from sample rows (the majority of recognisable rows wins).

    Raises:
        DatasetError: no row matches a supported format (the message lists the columns
            seen and the expected layouts), or the data is preference (chosen/rejected) data.
    """
    votes: Counter = Counter()
    columns: Counter = Counter()
    for data in rows:
        columns.update(data.keys())
        sig = row_signature(data)
        if sig:
            votes[sig] += 1
    if not votes:
        seen = ", ".join(repr(c) for c, _ in columns.most_common(12)) or "none"
        raise DatasetError(
            f"could not detect the dataset format from the columns {seen}; expected alpaca "
            "(instruction/input/output), sharegpt (conversations of from/value), messages "
            "(role/content), prompt/completion, or text; or map the columns (which one is "
            "the instruction, the output, ...) on the dataset's page")
    fmt = votes.most_common(1)[0][0]
    needs = ("supervised fine-tuning needs alpaca, sharegpt, messages, prompt/completion or text "
             "rows")
    if fmt == "preference":
        raise DatasetError("this is preference data (chosen/rejected columns, for DPO); " + needs)
    if fmt == "kto":
        flag = next(k for k in KTO_FLAGS if columns.get(k))
        bad = votes["kto"]
        raise DatasetError(f"this is KTO data: each row's answer carries a true/false {flag!r} "
                           f"(desirable or not; {bad} rows checked), for KTO training; supervised "
                           "fine-tuning would also teach the undesirable answers. Remove the "
                           f"{flag!r} column and the rows marked false to train on it; " + needs)
    return fmt


def _as_text(value, row: int, field: str, what: str, required: bool = True) -> str:
    if value is None:
        if required:
            raise DatasetError(f"missing {what}", row=row, field=field)
        return ""
    if not isinstance(value, str):
        raise DatasetError(f"{what} is a {type(value).__name__}, expected a string",
                           row=row, field=field)
    if required and not value.strip():
        raise DatasetError(f"empty {what}", row=row, field=field)
    return value


def validate_messages(messages: list[dict], row: int, fields: list[str]) -> list[dict]:
    """Check roles/order/content of a normalised conversation; drop empty system turns.

    ``fields[i]`` is the file's path of message i (for error locations). Returns the list.
    Raises DatasetError on: empty conversation, system turn not first, wrong role order,
    empty user/assistant/tool turn, no final assistant turn.
    """
    out, paths = [], []
    for i, (msg, path) in enumerate(zip(messages, fields)):
        if msg["role"] == "system":
            if i != 0:
                raise DatasetError("a system message may only come first", row=row, field=path)
            if not msg["content"].strip():
                continue
        elif not msg["content"].strip():
            raise DatasetError(f"empty {msg['role']} turn", row=row, field=path)
        out.append(msg)
        paths.append(path)
    body = [(m, p) for m, p in zip(out, paths) if m["role"] != "system"]
    if not body:
        raise DatasetError("the conversation has no user/assistant turns", row=row,
                           field=fields[0].split("[")[0] if fields else None)
    allowed_after = {None: {"user"}, "user": {"assistant"}, "assistant": {"user", "tool"},
                     "tool": {"tool", "assistant"}}
    prev = None
    for msg, path in body:
        if msg["role"] not in allowed_after[prev]:
            expected = " or ".join(sorted(allowed_after[prev]))
            after = f"after a {prev} turn" if prev else "as the first turn (after any system message)"
            raise DatasetError(f"wrong role order: {msg['role']} turn {after}; expected {expected}",
                               row=row, field=path.rsplit(".", 1)[0] + ".role" if "." in path else path)
        prev = msg["role"]
    if prev != "assistant":
        raise DatasetError(f"the conversation ends with a {prev} turn; the last turn must be the "
                           "assistant's (nothing would be trained after it)", row=row, field=body[-1][1])
    return out


def _tools_of(value, row: int, field: str) -> list | None:
    if value in (None, "", []):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"tools is a string but not valid JSON: {exc.msg}", row=row, field=field) from None
        except RecursionError:
            raise DatasetError("tools is a string of JSON nested too deeply", row=row,
                               field=field) from None
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise DatasetError("tools must be a list of function specs", row=row, field=field)
    return [t if "function" in t and "type" in t else {"type": "function", "function": t} for t in value]


def _conversation(data: dict, row: int) -> tuple[str, list]:
    key = next(k for k in CONV_KEYS if k in data)
    conv = data[key]
    if not isinstance(conv, list):
        raise DatasetError(f"{key} is a {type(conv).__name__}, expected a list", row=row, field=key)
    return key, conv


def _with_tools(messages: list[dict], fields: list[str], data: dict, row: int) -> dict:
    out = {"messages": validate_messages(messages, row, fields)}
    tools = _tools_of(data.get("tools"), row, "tools")
    if tools:
        out["tools"] = tools
    return out


def _norm_sharegpt(data: dict, row: int) -> dict:
    key, conv = _conversation(data, row)
    messages, fields = [], []
    if isinstance(data.get("system"), str) and data["system"].strip():
        messages.append({"role": "system", "content": data["system"]})
        fields.append("system")
    for i, turn in enumerate(conv):
        base = f"{key}[{i}]"
        if not isinstance(turn, dict):
            raise DatasetError(f"turn is a {type(turn).__name__}, expected an object", row=row, field=base)
        who = turn.get("from", turn.get("role"))
        if not isinstance(who, str) or who.strip().lower() not in SHAREGPT_ROLES:
            raise DatasetError(f"unknown speaker {who!r}; expected one of human, gpt, system, "
                               "function_call, observation", row=row, field=f"{base}.from")
        role = SHAREGPT_ROLES[who.strip().lower()]
        content = _as_text(turn.get("value", turn.get("content")), row, f"{base}.value",
                           f"{role} turn", required=False)
        messages.append({"role": role, "content": content})
        fields.append(f"{base}.value")
    return _with_tools(messages, fields, data, row)


def _content_of(value, row: int, field: str, role: str, msg: dict) -> str:
    if isinstance(value, list):
        parts = []
        for j, part in enumerate(value):
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise DatasetError(f"content part of type {kind!r} is not supported (text only)",
                                   row=row, field=f"{field}[{j}]")
        return "".join(parts)
    if value is None and role == "assistant" and msg.get("tool_calls"):
        calls = [c.get("function", c) if isinstance(c, dict) else c for c in msg["tool_calls"]]
        return json.dumps(calls[0] if len(calls) == 1 else calls, ensure_ascii=False)
    return _as_text(value, row, field, f"{role} turn", required=False)


def message_role(msg: Any, base: str, row: int | None = None) -> str:
    """The canonical role (system, user, assistant or tool) of the OpenAI-style message ``msg``
    at field ``base`` (``messages[2]``) of row ``row``: the one check of a message's shape and
    role, for SFT rows and GRPO prompt cells (:func:`app.data.prompts.message_problem`) alike.

    Raises:
        DatasetError: ``msg`` is not an object (field ``base``), or its role is unknown (field
            ``base.role``).
    """
    if not isinstance(msg, dict):
        raise DatasetError(f"message is a {type(msg).__name__}, expected an object", row=row,
                           field=base)
    role = msg.get("role")
    if not isinstance(role, str) or role.strip().lower() not in MESSAGE_ROLES:
        raise DatasetError(f"unknown role {role!r}; expected system, user, assistant or tool",
                           row=row, field=f"{base}.role")
    return MESSAGE_ROLES[role.strip().lower()]


def _norm_messages(data: dict, row: int) -> dict:
    key, conv = _conversation(data, row)
    messages, fields = [], []
    for i, msg in enumerate(conv):
        base = f"{key}[{i}]"
        role = message_role(msg, base, row)
        messages.append({"role": role, "content": _content_of(msg.get("content"), row,
                                                              f"{base}.content", role, msg)})
        fields.append(f"{base}.content")
    return _with_tools(messages, fields, data, row)


def _norm_alpaca(data: dict, row: int) -> dict:
    instruction = _as_text(data.get("instruction"), row, "instruction", "instruction", required=False)
    inp = _as_text(data.get("input"), row, "input", "input", required=False)
    output = _as_text(data.get("output"), row, "output", "output")
    user = "\n\n".join(p for p in (instruction.strip(), inp.strip()) if p)
    if not user:
        raise DatasetError("empty instruction (and no input)", row=row, field="instruction")
    messages, fields = [], []
    system = data.get("system")
    if system is not None:
        system = _as_text(system, row, "system", "system prompt", required=False)
        messages.append({"role": "system", "content": system})
        fields.append("system")
    history = data.get("history") or []
    if not isinstance(history, list):
        raise DatasetError("history must be a list of [instruction, response] pairs", row=row, field="history")
    for i, pair in enumerate(history):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise DatasetError("history entry must be an [instruction, response] pair", row=row,
                               field=f"history[{i}]")
        messages.append({"role": "user", "content": _as_text(pair[0], row, f"history[{i}][0]", "user turn")})
        messages.append({"role": "assistant", "content": _as_text(pair[1], row, f"history[{i}][1]",
                                                                  "assistant turn")})
        fields += [f"history[{i}][0]", f"history[{i}][1]"]
    messages += [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
    fields += ["instruction", "output"]
    return {"messages": validate_messages(messages, row, fields)}


def _norm_prompt_completion(data: dict, row: int, warnings: list[RowIssue]) -> dict:
    ckey = next((k for k in COMPLETION_KEYS if k in data), "completion")
    prompt, completion = data.get("prompt"), data.get(ckey)
    if isinstance(prompt, list) and isinstance(completion, list):  # TRL conversational form
        return _norm_messages({"messages": prompt + completion}, row)
    prompt = _as_text(prompt, row, "prompt", "prompt")
    completion = _as_text(completion, row, ckey, ckey)
    if EOS_MARKER_RE.search(completion):
        completion = EOS_MARKER_RE.sub("", completion)
        warnings.append(RowIssue(row, ckey, "the literal marker '###eos_token###' was stripped; "
                                 "the tokenizer's real EOS token is appended instead"))
        if not completion.strip():
            raise DatasetError(f"empty {ckey} (only an EOS marker)", row=row, field=ckey)
    marker = next((m for m in PRETEMPLATE_MARKERS if m in prompt), None)
    if marker:
        warnings.append(RowIssue(row, "prompt", f"the prompt already contains a template ({marker!r}); "
                                 "it is used verbatim and the chat template is not applied on top"))
    return {"prompt": prompt, "completion": completion}


def _norm_text(data: dict, row: int) -> dict:
    return {"text": _as_text(data.get("text"), row, "text", "text")}


def _norm_oasst_tree(data: dict, row: int) -> dict:
    node = data.get("prompt")
    if not isinstance(node, dict):
        raise DatasetError("missing the tree's prompt message", row=row, field="prompt")
    if node.get("synthetic"):
        raise DatasetError("synthetic (model-written) conversation tree; skipped", row=row,
                           field="prompt.synthetic")
    messages, fields, path = [], [], "prompt"
    while True:
        if node.get("deleted"):
            break
        role = {"prompter": "user", "assistant": "assistant"}.get(node.get("role"))
        if role is None:
            raise DatasetError(f"unknown role {node.get('role')!r}", row=row, field=f"{path}.role")
        messages.append({"role": role, "content": _as_text(node.get("text"), row, f"{path}.text",
                                                           f"{role} turn", required=False)})
        fields.append(f"{path}.text")
        replies = [(i, r) for i, r in enumerate(node.get("replies") or [])
                   if isinstance(r, dict) and not r.get("deleted")]
        if not replies:
            break
        i, node = min(replies, key=lambda ir: (bool(ir[1].get("synthetic")),
                                               ir[1].get("rank") if ir[1].get("rank") is not None else 1e9))
        path = f"{path}.replies[{i}]"
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()
        fields.pop()
    if not messages:
        raise DatasetError("the tree has no assistant reply", row=row, field="prompt.replies")
    return {"messages": validate_messages(messages, row, fields)}


def normalize_row(data: dict, fmt: str, row: int) -> tuple[dict, list[RowIssue]]:
    """Normalise one row to a canonical example.

    Args:
        data: the row as read by :mod:`app.data.loader`.
        fmt: one of ``FORMATS``.
        row: 1-based row number (for error locations).

    Returns:
        (example, warnings) — warnings are non-fatal notes about the row.

    Raises:
        DatasetError: the row is invalid (with ``row`` and ``field`` set).
    """
    bad = find_surrogate(data)
    if bad is not None:
        raise DatasetError(f"{bad[1]}: not text; remove it or re-save the file", row=row,
                           field=bad[0] or None)
    warnings: list[RowIssue] = []
    if fmt in ("sharegpt", "messages"):
        if not any(k in data for k in CONV_KEYS):
            raise DatasetError("missing conversation list", row=row,
                               field="conversations" if fmt == "sharegpt" else "messages")
        ex = _norm_sharegpt(data, row) if fmt == "sharegpt" else _norm_messages(data, row)
    elif fmt == "alpaca":
        ex = _norm_alpaca(data, row)
    elif fmt == "prompt_completion":
        ex = _norm_prompt_completion(data, row, warnings)
    elif fmt == "text":
        ex = _norm_text(data, row)
    elif fmt == "oasst_tree":
        ex = _norm_oasst_tree(data, row)
    else:
        raise DatasetError(f"unknown dataset format {fmt!r}")
    return ex, warnings


#: What a column mapping may name, in the order a form lists them: the alpaca fields.
MAPPING_ROLES = ("instruction", "input", "output", "system")


def check_column_mapping(mapping: dict | None, columns: Iterable[str] | None = None
                         ) -> dict[str, str] | None:
    """A cleaned column mapping ``{role: column}`` (roles of :data:`MAPPING_ROLES`; empty
    entries dropped), or None when nothing is mapped.

    Raises:
        DatasetError: an unknown role, no ``instruction`` or ``output`` column, one column
            named for two roles, or (with ``columns``) a column the file does not have; the
            error's ``field`` is the role.
    """
    if not mapping:
        return None
    clean = {}
    for role, col in mapping.items():
        if role not in MAPPING_ROLES:
            raise DatasetError(f"unknown column role {role!r}; use {', '.join(MAPPING_ROLES)}",
                               field=role)
        if isinstance(col, str) and col.strip():
            clean[role] = col.strip()
    if not clean:
        return None
    for role in ("instruction", "output"):
        if role not in clean:
            raise DatasetError(f"choose the column that holds the {role}", field=role)
    seen: dict[str, str] = {}
    for role, col in clean.items():
        if col in seen:
            raise DatasetError(f"column {col!r} is already the {seen[col]}", field=role)
        seen[col] = role
    if columns is not None:
        have = list(columns)
        for role, col in clean.items():
            if col not in have:
                raise DatasetError(f"the file has no column {col!r} (columns: "
                                   f"{', '.join(have) or 'none'})", field=role)
    return {role: clean[role] for role in MAPPING_ROLES if role in clean}


def _cell_text(value):
    """A mapped cell as the alpaca field reads it: numbers and booleans as their text (a CSV's
    label, a JSON answer that is a number), anything else unchanged."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return str(value)
    return value


def apply_column_mapping(data: dict, mapping: dict[str, str]) -> dict:
    """The alpaca row (``instruction``, ``input``, ``output``, ``system``) that ``mapping``
    (``{role: column}``, see :func:`check_column_mapping`) makes of one of the file's rows."""
    return {role: _cell_text(data.get(col)) for role, col in mapping.items()}


def example_kind(example: dict) -> str:
    """``messages``, ``text`` or ``prompt_completion`` for a canonical example."""
    if "messages" in example:
        return "messages"
    if "text" in example:
        return "text"
    return "prompt_completion"

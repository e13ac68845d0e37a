"""Reduce a Hugging Face Jinja chat template to fixed text pieces by rendering probes.

The template is rendered (with transformers' ``render_jinja_template``, the code behind
``apply_chat_template``) on conversations whose contents are unique markers; the text between
markers gives the pieces of a :class:`ChatLayout`:

``head`` (BOS, default system block) · per message ``pre[role] + content + post[role]`` ·
``gen`` (generation prompt) — and where the system prompt goes:

* ``block``: its own block ``sys_head + system + sys_post`` before the messages (Llama 3.x,
  Qwen2.5, Phi-3.5, DeepSeek-R1-Distill);
* ``first_user`` / ``last_user``: prepended to the first / last user content with a separator
  (Llama 2, Mistral-Nemo);
* ``merged``: the template rejects a system role (Gemma 2 raises "System role not supported");
  the system prompt is then merged into the first user message as ``system + "\\n\\n" + user``,
  i.e. we compare against the Jinja rendering of that merged conversation.

Assumptions (checked by re-rendering every probe; a template that breaks them raises
:class:`ExportError`): user/assistant turns alternate and the conversation ends with a user
turn; contents carry no leading/trailing whitespace (templates that ``| trim`` see the same
text); the template's date, if it prints one, is frozen at export time.
"""
from __future__ import annotations

import re

from dataclasses import dataclass, field

from .files import ExportError

S, U1, A1, U2, A2, U3 = ("\ue010SYS\ue011", "\ue010U1\ue011", "\ue010A1\ue011", "\ue010U2\ue011",
                         "\ue010A2\ue011", "\ue010U3\ue011")
MERGE_SEP = "\n\n"


@dataclass
class ChatLayout:
    """Fixed text pieces of a chat template (see the module docstring)."""

    system_mode: str  # block | first_user | last_user | merged
    head: str  # text before the messages when no system prompt is given
    sys_head: str = ""  # block mode: text before the system prompt
    sys_post: str = ""  # block: text after it; first/last_user/merged: separator before user
    user_pre: str = ""
    user_post: str = ""
    asst_pre: str = ""
    asst_post: str = ""
    gen: str = ""
    stops: list[str] = field(default_factory=list)  # Ollama stop strings, end-of-turn first
    end_of_turn: list[str] = field(default_factory=list)  # the special token closing a turn


def end_marker(between: str, asst_pre: str, special_tokens) -> str | None:
    """The special token that ends an assistant turn, or None.

    ``between`` is the text a template puts between an assistant's content and the next user's
    content; ``asst_pre`` the text opening an assistant turn. The end-of-turn marker is the
    first special token (by position) in ``between`` that does not also open the assistant
    turn: turn-START markers (``<|im_start|>``, ``<|start_header_id|>``, ``<start_of_turn>``)
    open both user and assistant turns, so they are never taken for the end of one.
    """
    best = None
    for tok in set(special_tokens):
        at = between.find(tok) if tok else -1
        if at < 0 or tok in asst_pre:
            continue
        if best is None or (at, -len(tok)) < (best[0], -len(best[1])):
            best = (at, tok)
    return best[1] if best else None


def render(template: str, messages: list[dict], add_generation_prompt: bool = True,
           special: dict | None = None, **extra) -> str:
    """Render like ``tokenizer.apply_chat_template(..., tokenize=False)``."""
    from transformers.utils.chat_template_utils import render_jinja_template

    kwargs = dict(special or {})
    kwargs.update(extra)
    out, _ = render_jinja_template(conversations=[messages], chat_template=template,
                                   add_generation_prompt=add_generation_prompt, **kwargs)
    return out[0]


def _m(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def _cut(text: str, markers: list[str]) -> list[str]:
    """Split ``text`` at markers that must appear once each, in order."""
    parts, rest = [], text
    for mk in markers:
        if rest.count(mk) != 1:
            raise ExportError(f"chat template: probe content {mk!r} appears {rest.count(mk)} "
                              "times; the template rewrites or repeats message contents")
        before, rest = rest.split(mk)
        parts.append(before)
    parts.append(rest)
    return parts


def _common_suffix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def derive_layout(template: str, special: dict | None = None, special_tokens: list[str] = (),
                  **extra) -> ChatLayout:
    """Probe ``template`` and return its :class:`ChatLayout`; raises :class:`ExportError`.

    ``special``: template variables such as ``bos_token``/``eos_token``; ``special_tokens``:
    the tokenizer's special-token strings (used to name the end-of-turn stop strings).
    """
    r = lambda msgs, gen=True: render(template, msgs, gen, special, **extra)  # noqa: E731
    convo = [_m("user", U1), _m("assistant", A1), _m("user", U2), _m("assistant", A2),
             _m("user", U3)]
    b0, b1, b2, b3, b4, b5 = _cut(r(convo), [U1, A1, U2, A2, U3])
    if b1 != b3 or b2 != b4:
        raise ExportError("chat template: turns are not rendered uniformly")
    # Generation prompt = what add_generation_prompt appends (when the render is a prefix).
    with_gen, without = r(convo[:1]), r(convo[:1], False)
    gen = with_gen[len(without):] if with_gen.startswith(without) else ""
    # b5 = user_post + gen ; b1 = user_post + asst_pre
    if gen and b5.endswith(gen):
        user_post = b5[:len(b5) - len(gen)]
    else:
        user_post, gen = b5, ""
    if not b1.startswith(user_post):
        raise ExportError("chat template: the text after a user turn depends on what follows")
    asst_pre = b1[len(user_post):]
    # b2 = asst_post + user_pre ; b0 = head + user_pre. Prefer asst_post = end-of-turn marker.
    split = len(b2) - _common_suffix(b0, b2)
    eot = end_marker(b2, asst_pre, special_tokens)
    if eot is not None:  # end the turn after its marker (and the whitespace that follows it)
        end = b2.find(eot) + len(eot)
        while end < len(b2) and b2[end] in "\n ":
            end += 1
        split = max(split, end)
    for tok in special_tokens:  # never split a special token
        at = b2.find(tok) if tok else -1
        if 0 <= at < split < at + len(tok):
            split = at + len(tok)
    asst_post, user_pre = b2[:split], b2[split:]
    if not b0.endswith(user_pre):
        raise ExportError("chat template: the first user turn differs from later ones")
    head = b0[:len(b0) - len(user_pre)]
    lay = ChatLayout("block", head, user_pre=user_pre, user_post=user_post, asst_pre=asst_pre,
                     asst_post=asst_post, gen=gen, end_of_turn=[eot] if eot else [])
    _system(lay, r, convo)
    stop_text = asst_post + user_pre
    found = sorted((stop_text.find(t), -len(t), t) for t in set(special_tokens)
                   if t and t in stop_text)
    lay.stops = [t for _, _, t in found]  # in order of appearance: the end-of-turn marker first
    if not lay.stops:  # markers the vocabulary has no token for (ChatML on a base model):
        lay.stops = _MARKER.findall(stop_text)[:1]  # Ollama stops on the first marker's text
    _self_check(lay, r)
    return lay


#: A chat marker written as text: <|im_end|>, <end_of_turn>, <｜end▁of▁sentence｜>, ...
_MARKER = re.compile(r"<[|｜]?[A-Za-z_▁][^<>\s]{0,40}?[|｜]?>")


def _self_check(lay: ChatLayout, r) -> None:
    """Re-render probe conversations of 1/3/5 turns, with and without a system prompt."""
    turns = [_m("user", "hello there"), _m("assistant", "Hi! How can I help?"),
             _m("user", "Tell me a story."), _m("assistant", "Once upon a time."),
             _m("user", "Thanks")]
    for n in (1, 3, 5):
        for system in (None, "You are terse."):
            msgs = ([_m("system", system)] if system else []) + turns[:n]
            want = r(reference_messages(lay, msgs))
            got = expected_render(lay, msgs)
            if got != want:
                raise ExportError(f"chat template could not be reduced to fixed pieces "
                                  f"({n} turns, system={bool(system)}): expected {want!r}, "
                                  f"got {got!r}")


def _system(lay: ChatLayout, r, convo: list[dict]) -> None:
    """Find where the system prompt goes (mutates ``lay``)."""
    try:
        text = r([_m("system", S)] + convo)
    except Exception as e:  # noqa: BLE001 - raise_exception() surfaces as TemplateError
        if "system" not in str(e).lower():
            raise ExportError(f"chat template failed on a system message: {e}") from e
        lay.system_mode, lay.sys_post = "merged", MERGE_SEP
        return
    if text.count(S) != 1:
        raise ExportError("chat template: the system prompt is dropped or repeated")
    before, after = text.split(S)
    plain = expected_render(lay, convo)
    body = plain[len(lay.head):]
    if after.endswith(body):  # its own block before the messages
        lay.system_mode, lay.sys_head = "block", before
        lay.sys_post = after[:len(after) - len(body)]
        return
    first_pre = lay.head + lay.user_pre
    if before.startswith(first_pre) and U1 in after and after.index(U1) < after.find(A1):
        lay.system_mode, lay.sys_head = "first_user", before[len(first_pre):]
        lay.sys_post = after[:after.index(U1)]
        return
    last_pre = plain[:plain.index(U3)]
    if before.startswith(last_pre) and U3 in after:
        lay.system_mode, lay.sys_head = "last_user", before[len(last_pre):]
        lay.sys_post = after[:after.index(U3)]
        return
    raise ExportError("chat template: cannot tell where the system prompt goes")


def expected_render(lay: ChatLayout, messages: list[dict]) -> str:
    """Render ``messages`` from the layout (the semantics the Go template must have)."""
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    turns = [m for m in messages if m["role"] != "system"]
    out = [lay.sys_head + system + lay.sys_post if system and lay.system_mode == "block"
           else lay.head]
    users = [i for i, m in enumerate(turns) if m["role"] == "user"]
    for i, m in enumerate(turns):
        last = i == len(turns) - 1
        if m["role"] == "user":
            inject = system and ((lay.system_mode in ("first_user", "merged") and i == users[0])
                                 or (lay.system_mode == "last_user" and i == users[-1]))
            pre = lay.sys_head + system + lay.sys_post if inject else ""
            out.append(lay.user_pre + pre + m["content"] + lay.user_post + (lay.gen if last else ""))
        else:
            out.append(lay.asst_pre + m["content"] + ("" if last else lay.asst_post))
    return "".join(out)


def reference_messages(lay: ChatLayout, messages: list[dict]) -> list[dict]:
    """The conversation to give the Jinja template for comparison (merged mode folds the
    system prompt into the first user message, as the template cannot take one)."""
    if lay.system_mode != "merged":
        return messages
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    turns = [dict(m) for m in messages if m["role"] != "system"]
    if system and turns:
        turns[0]["content"] = system + MERGE_SEP + turns[0]["content"]
    return turns

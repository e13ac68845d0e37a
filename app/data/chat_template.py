"""Render conversations with Jinja chat templates (Hugging Face semantics) and locate the
assistant text, so training can mask everything but the responses.

Rendering follows ``transformers``' ``apply_chat_template``: a sandboxed
``ImmutableSandboxedEnvironment`` with ``trim_blocks``/``lstrip_blocks``, the
``loopcontrols`` extension, a ``{% generation %}`` block tag (rendered as its body), the
``tojson`` filter of transformers (no HTML escaping, ``ensure_ascii=False``, optional
``indent``/``separators``/``sort_keys``), the globals ``raise_exception`` and
``strftime_now``, and the variables ``messages``, ``tools``, ``add_generation_prompt``,
``bos_token``, ``eos_token`` and any other special tokens of the tokenizer.

Assistant spans are found without ``{% generation %}`` tags: the conversation is rendered
a second time with every assistant content replaced by a unique placeholder, which splits
the output into the template's own text pieces; the real rendering is then walked piece by
piece, so each assistant content is located exactly even when the template trims it or
drops a ``<think>`` block.  Each span also covers the turn's end-of-turn marker (e.g.
``<|im_end|>``, ``<|eot_id|>``, ``</s>``): the text the template writes right after the
content, up to the first whitespace (for the final turn, everything the template writes
after it, trailing whitespace excluded — e.g. Phi-3.5's ``<|end|>\\n<|endoftext|>``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import DatasetError

_PH_OPEN, _PH_CLOSE = "\ue000", "\ue001"


class TemplateRaised(Exception):
    """Raised by a template's ``raise_exception(msg)``."""


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}``: rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message):
    raise TemplateRaised(message)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=64)
def compile_template(template: str) -> jinja2.Template:
    """Compile a chat template (cached).

    Raises:
        DatasetError: the template does not parse (message names the line).
    """
    if not isinstance(template, str) or not template.strip():
        raise DatasetError("the chat template is empty")
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise DatasetError(f"the chat template does not parse: line {exc.lineno}: {exc.message}") from None


def render_chat(messages: list[dict], template: str, *, bos_token: str = "", eos_token: str = "",
                add_generation_prompt: bool = False, tools: list | None = None,
                special_tokens: dict[str, str] | None = None) -> str:
    """Render ``messages`` with a chat template and return the text.

    ``special_tokens`` (e.g. ``{"pad_token": "<pad>"}``) are passed as template variables.

    Raises:
        DatasetError: the template raised (``raise_exception``) or failed on this
            conversation; the message quotes the template's reason.
    """
    tpl = compile_template(template)
    variables = dict(special_tokens or {})
    variables.update(bos_token=bos_token, eos_token=eos_token)
    try:
        return tpl.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                          **variables)
    except TemplateRaised as exc:
        raise DatasetError(f"the chat template rejected this conversation: {exc}") from None
    except Exception as exc:  # jinja2 UndefinedError, TypeError... inside a foreign template
        raise DatasetError(f"the chat template failed on this conversation: "
                           f"{type(exc).__name__}: {exc}") from None


@dataclass
class RenderedChat:
    """A rendered conversation.

    Attributes:
        text: the full rendered text (as ``apply_chat_template(tokenize=False)``).
        assistant_spans: ``[(start, end), ...]`` character offsets into ``text`` (end
            exclusive) of each assistant turn: its content plus its end-of-turn marker.
        content_spans: the same spans without the end-of-turn marker.
    """

    text: str
    assistant_spans: list[tuple[int, int]] = field(default_factory=list)
    content_spans: list[tuple[int, int]] = field(default_factory=list)


def _content_variants(content: str) -> list[str]:
    after_think = content.split("</think>")[-1]
    seen, out = set(), []
    for v in (content, content.strip(), after_think, after_think.strip(), content.lstrip(),
              content.rstrip(), after_think.lstrip()):
        if v not in seen:
            seen.add(v)
            out.append(v)
    return out


def _end_of_turn(tail: str, last_tail: str, is_last: bool) -> str:
    """The end-of-turn text that starts ``tail`` (the template text after a content)."""
    final = last_tail.rstrip()
    if is_last:
        return final
    cuts = [i for i, ch in enumerate(final) if ch.isspace()] + [len(final)]
    for cut in sorted(set(cuts), reverse=True):
        prefix = final[:cut].rstrip()
        if prefix and tail.startswith(prefix):
            return prefix
    return ""


def _locate_by_pieces(text: str, pieces: list[str], contents: list[str]) -> list[tuple[int, int]] | None:
    if not text.startswith(pieces[0]):
        return None
    pos, spans = len(pieces[0]), []
    for i, content in enumerate(contents):
        nxt, last = pieces[i + 1], i == len(contents) - 1
        found = None
        for cand in _content_variants(content):
            if (text[pos:] == cand + nxt) if last else text.startswith(cand + nxt, pos):
                found = cand
                break
        if found is None:
            if last:
                if not text.endswith(nxt) or len(text) - len(nxt) < pos:
                    return None
                found = text[pos:len(text) - len(nxt)]
            else:
                idx = text.find(nxt, pos) if nxt else -1
                if idx < 0:
                    return None
                found = text[pos:idx]
        spans.append((pos, pos + len(found)))
        pos += len(found) + len(nxt)
    return spans if pos == len(text) else None


def _locate_by_search(text: str, messages: list[dict]) -> list[tuple[int, int]]:
    pos, spans = 0, []
    for i, msg in enumerate(messages):
        if msg["role"] == "system":
            continue
        hit = None
        for cand in _content_variants(msg["content"]):
            idx = text.find(cand, pos) if cand else -1
            if idx >= 0:
                hit = (idx, idx + len(cand))
                break
        if hit is None:
            if msg["role"] == "assistant":
                raise DatasetError(f"the chat template rewrites assistant message {i}; its text "
                                   "cannot be located in the rendering to build the loss mask")
            continue
        pos = hit[1]
        if msg["role"] == "assistant":
            spans.append(hit)
    return spans


def render_with_spans(messages: list[dict], template: str, *, bos_token: str = "",
                      eos_token: str = "", tools: list | None = None,
                      special_tokens: dict[str, str] | None = None) -> RenderedChat:
    """Render a conversation and locate each assistant turn (content + end-of-turn).

    Raises:
        DatasetError: the template fails on the conversation, or an assistant content
            cannot be located in the rendering.
    """
    kw = dict(bos_token=bos_token, eos_token=eos_token, tools=tools, special_tokens=special_tokens)
    text = render_chat(messages, template, **kw)
    idxs = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not idxs:
        return RenderedChat(text)
    contents = [messages[i]["content"] for i in idxs]
    marked = [dict(m) for m in messages]
    for n, i in enumerate(idxs):
        marked[i]["content"] = f"{_PH_OPEN}{n}{_PH_CLOSE}"
    spans = None
    try:
        skeleton = render_chat(marked, template, **kw)
        pieces, rest = [], skeleton
        for n in range(len(idxs)):
            before, sep, rest = rest.partition(f"{_PH_OPEN}{n}{_PH_CLOSE}")
            if not sep or _PH_OPEN in before:
                raise ValueError("placeholder lost")
            pieces.append(before)
        if _PH_OPEN in rest:
            raise ValueError("placeholder repeated")
        pieces.append(rest)
        spans = _locate_by_pieces(text, pieces, contents)
    except (DatasetError, ValueError):
        pieces = None
    if spans is None:
        spans = _locate_by_search(text, messages)
        pieces = [""] + [text[e:(spans[k + 1][0] if k + 1 < len(spans) else len(text))]
                         for k, (s, e) in enumerate(spans)]
    full = []
    for k, (s, e) in enumerate(spans):
        eot = _end_of_turn(pieces[k + 1], pieces[-1], k == len(spans) - 1)
        full.append((s, e + len(eot)))
    return RenderedChat(text, full, list(spans))


# --- built-in templates for models without one (written for Whetstone) -------------------

_CHATML = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- 'You can call these functions; reply with a JSON object {\"name\", \"arguments\"} to call one:\\n' }}"
    "{%- for t in tools %}{{- t | tojson + '\\n' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages if m.role != 'system' %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_LLAMA3 = (
    "{{- bos_token }}"
    "{%- for m in messages %}"
    "{%- set role = 'ipython' if m.role == 'tool' else m.role %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + m.content | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

_ALPACA = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}"
    "{%- else %}{{- 'Below is an instruction that describes a task. Write a response that '"
    " 'appropriately completes the request.\\n\\n' }}{%- endif %}"
    "{%- for m in messages if m.role != 'system' %}"
    "{%- if m.role == 'user' %}{{- '### Instruction:\\n' + m.content + '\\n\\n' }}"
    "{%- elif m.role == 'tool' %}{{- '### Observation:\\n' + m.content + '\\n\\n' }}"
    "{%- else %}{{- '### Response:\\n' + m.content + eos_token + '\\n\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '### Response:\\n' }}{%- endif %}"
)

_ZEPHYR = (
    "{%- for m in messages %}"
    "{{- '<|' + m.role + '|>\\n' + m.content + eos_token + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)

DEFAULT_TEMPLATES: dict[str, str] = {
    "chatml": _CHATML,
    "llama3": _LLAMA3,
    "alpaca": _ALPACA,
    "zephyr": _ZEPHYR,
}
DEFAULT_TEMPLATE_DESCRIPTIONS: dict[str, str] = {
    "chatml": "ChatML: <|im_start|>role ... <|im_end|> (Qwen, many community models)",
    "llama3": "Llama 3 headers: <|start_header_id|>role<|end_header_id|> ... <|eot_id|>",
    "alpaca": "Alpaca: ### Instruction / ### Response, each response ends with EOS",
    "zephyr": "Zephyr: <|user|> / <|assistant|> blocks, each ended by EOS",
}


def list_default_templates() -> list[dict]:
    """The built-in templates for the run form: ``[{"name", "description", "template"}]``."""
    return [{"name": n, "description": DEFAULT_TEMPLATE_DESCRIPTIONS[n], "template": t}
            for n, t in DEFAULT_TEMPLATES.items()]


def resolve_template(name_or_source: str | None, model_template: str | None = None) -> str | None:
    """Pick the template to use: a built-in name, else literal Jinja source, else the model's.

    Returns None when none is given and the model has none.
    Raises:
        DatasetError: the given Jinja source does not parse.
    """
    if name_or_source:
        key = name_or_source.strip().lower()
        if key in DEFAULT_TEMPLATES:
            return DEFAULT_TEMPLATES[key]
        compile_template(name_or_source)
        return name_or_source
    return model_template


#: The built-in template a run uses when neither the run nor the model names one (the dataset
#: preview and the run form start from the same one).
FALLBACK_TEMPLATE = "chatml"


def choose_template(requested: str | None, model_template: str | None) -> tuple[str, str | None]:
    """The one decision of which chat template a run (and its preview) uses: ``(name, source)``.

    ``requested`` is a built-in name (``chatml``, ``llama3``, ...), Jinja source (name
    ``custom``), ``"model"``/None (the model's own template, name ``model``), or ``"none"`` (GRPO
    on a base model: prompts sent as they are; source None). With no template anywhere the
    built-in :data:`FALLBACK_TEMPLATE` is used. Called once when a run is created; the stored
    name and source are what the worker and every export use.

    Custom and model source is checked in a separate process under a time and memory budget
    (:func:`app.data.template_check.template_problem`: blocking, call it off the event loop).

    Raises:
        DatasetError: the chosen Jinja source does not compile, fails on or drops the messages
            of a sample chat, or runs over the budget (the message says which).
    """
    key = (requested or "").strip()
    if key.lower() == "none":
        return "none", None
    if key and key.lower() != "model":
        if key.lower() in DEFAULT_TEMPLATES:
            return key.lower(), DEFAULT_TEMPLATES[key.lower()]
        same = [n for n, src in DEFAULT_TEMPLATES.items() if src.strip() == key]
        if same:
            return same[0], DEFAULT_TEMPLATES[same[0]]
        return "custom", _checked(requested)
    if model_template:
        return "model", _checked(model_template)
    return FALLBACK_TEMPLATE, DEFAULT_TEMPLATES[FALLBACK_TEMPLATE]


def _checked(source: str) -> str:
    """``source`` once it passed the out-of-process check. Raises DatasetError otherwise."""
    from app.data.template_check import template_problem

    problem = template_problem(source)
    if problem:
        raise DatasetError(problem)
    return source

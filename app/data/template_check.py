"""Check a user's chat template in a separate, killable process with a time and memory budget.

Jinja evaluates constant expressions while it compiles (``{% if 10**(10**7) > 1 %}`` computes a
ten-million-digit number before any render), and a worker thread cannot be stopped, so an
untrusted template is compiled and test-rendered in a child Python process
(``python -m app.data.template_check``, the source on stdin, a JSON answer on stdout) under
:data:`TIME_BUDGET_S` of wall-clock time, :data:`MEMORY_BUDGET_MB` of address space and
:data:`OUTPUT_BUDGET_CHARS` of rendered text; it is killed when the time is up. The built-in
templates need no check; answers are cached per source (a timeout is not cached, since it may
be the machine's load).

Once a source has passed, compiling and rendering it in-process is safe: what froze the
process was the compile itself, and the sample render finished within the budget.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from collections import OrderedDict
from pathlib import Path

#: Wall-clock seconds for the child: start, compile and render the sample chats.
TIME_BUDGET_S = 5.0
#: Address-space limit of the child, MiB.
MEMORY_BUDGET_MB = 1024
#: Longest template source accepted, characters (the largest Hub templates are ~30k).
MAX_SOURCE_CHARS = 200_000
#: Longest rendering of a sample chat, characters.
OUTPUT_BUDGET_CHARS = 1_000_000

SAMPLE_CHATS = (
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "What is 2 + 2?"},
     {"role": "assistant", "content": "2 + 2 = 4."}],
    [{"role": "user", "content": "What is 2 + 2?"},
     {"role": "assistant", "content": "2 + 2 = 4."}],
)

_ROOT = Path(__file__).resolve().parents[2]
_cache: OrderedDict[str, str | None] = OrderedDict()
_cache_lock = threading.Lock()


def sample_problem(source: str) -> str | None:
    """In this process: why ``source`` cannot be used, else None.

    It must compile, render a sample system+user+assistant conversation (a template that refuses
    a system turn is accepted when it renders the same chat without one) within
    :data:`OUTPUT_BUDGET_CHARS`, and the render must contain every user and assistant message.
    Only call it on trusted source or inside the child (see :func:`template_problem`).
    """
    from app.data.chat_template import compile_template, render_chat
    from app.data.errors import DatasetError

    try:
        compile_template(source)
    except DatasetError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 -- constant folding runs user code: any error
        return f"the chat template fails while compiling: {type(exc).__name__}: {exc}"[:500]
    first = None
    for chat in SAMPLE_CHATS:
        try:
            text = render_chat(chat, source, bos_token="<s>", eos_token="</s>")
        except DatasetError as exc:
            first = first or str(exc)
            continue
        if len(text) > OUTPUT_BUDGET_CHARS:
            return (f"the chat template writes {len(text)} characters for a two-line sample chat "
                    f"(at most {OUTPUT_BUDGET_CHARS})")
        lost = [m["role"] for m in chat  # a template may fold or drop the system turn
                if m["role"] != "system" and m["content"] not in text]
        if lost:
            return (f"the template does not write the {' and '.join(lost)} messages (a sample "
                    f"chat renders as {text[:80]!r}); nothing would be trained")
        return None
    return first


def _builtin(source: str) -> bool:
    from app.data.chat_template import DEFAULT_TEMPLATES

    return any(source == s for s in DEFAULT_TEMPLATES.values())


def template_problem(source: str | None, *, timeout: float = TIME_BUDGET_S) -> str | None:
    """Why the chat template ``source`` cannot be used, else None; checked in a child process.

    Blocking for up to ``timeout`` seconds (call it off the event loop). The message is the
    template's own (``raise_exception`` text, the syntax error and line, the exception while
    compiling), names the messages it drops, or says it ran over the time or memory budget.
    """
    if not source or _builtin(source):
        return None
    if len(source) > MAX_SOURCE_CHARS:
        return (f"the chat template is {len(source)} characters long; at most "
                f"{MAX_SOURCE_CHARS} are accepted")
    key = hashlib.sha256(source.encode("utf-8", "surrogatepass")).hexdigest()
    with _cache_lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    problem, cacheable = _check_in_child(source, timeout)
    if cacheable:
        with _cache_lock:
            _cache[key] = problem
            while len(_cache) > 256:
                _cache.popitem(last=False)
    return problem


def _check_in_child(source: str, timeout: float) -> tuple[str | None, bool]:
    """(problem, whether the answer may be cached) from ``python -m app.data.template_check``."""
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "HOME")}
    env["PYTHONPATH"] = str(_ROOT)
    try:
        done = subprocess.run([sys.executable, "-m", "app.data.template_check"], cwd=_ROOT, env=env,
                              input=json.dumps({"source": source}).encode("utf-8", "surrogatepass"),
                              capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return (f"the chat template took more than {timeout:g} s to compile and render a sample "
                "chat (a constant expression such as 10**(10**7) is computed while it compiles); "
                "simplify it"), False
    try:
        return json.loads(done.stdout)["problem"], True
    except (ValueError, KeyError, TypeError):
        why = "ran out of memory" if b"MemoryError" in done.stderr else f"exit code {done.returncode}"
        return (f"the chat template could not be checked: compiling and rendering a sample chat "
                f"{why} (budget {MEMORY_BUDGET_MB} MiB)"), done.returncode != 0


def _main() -> None:
    """The child: limits on itself, then the source from stdin, ``{"problem": ...}`` out."""
    import resource

    limit = MEMORY_BUDGET_MB * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    cpu = int(TIME_BUDGET_S) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    source = json.loads(sys.stdin.buffer.read())["source"]
    try:
        problem = sample_problem(source)
    except MemoryError:
        problem = (f"the chat template needs more than {MEMORY_BUDGET_MB} MiB to compile and "
                   "render a sample chat")
    except RecursionError:
        problem = "the chat template is nested too deeply to compile"
    sys.stdout.write(json.dumps({"problem": problem}))


if __name__ == "__main__":
    _main()

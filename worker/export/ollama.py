r"""Ollama export: a Modelfile for the GGUF, and model creation on an Ollama server.

Modelfile (Ollama ``docs/modelfile.md``)::

    FROM ./model-Q4_K_M.gguf
    TEMPLATE '''<Go template from worker.export.gotemplate>'''  (written with triple double quotes)
    PARAMETER stop "<|im_end|>"          one line per end-of-turn marker
    SYSTEM '''<the run's system prompt>'''   only when the run had one

The TEMPLATE is derived from the run's Jinja chat template (:mod:`worker.export.chat`) and checked
at export time: for probe conversations (system + multi-turn, ending on a user turn) the
template, executed as Ollama would, must equal the Jinja rendering byte for byte (minus a leading
BOS text, which llama.cpp adds as a token).

Creation over HTTP (Ollama ``docs/api.md``): ``HEAD /api/blobs/sha256:<hex>`` (200 = present),
``POST /api/blobs/sha256:<hex>`` with the file as body (201; 400 on digest mismatch), then
``POST /api/create`` with ``{"model", "files": {"<name>.gguf": "sha256:<hex>"}, "template",
"system", "parameters": {"stop": [...]}, "stream": true}`` answered by JSON lines
``{"status": ...}`` ending in ``{"status": "success"}`` (or ``{"error": ...}``).
"""
from __future__ import annotations

import http.client
import json
import shlex
import urllib.parse
from pathlib import Path

from .chat import ChatLayout
from .files import CHUNK, ExportError, ProgressFn, noop_progress, sha256_file
from .gotemplate import execute, go_template, ollama_values


def _quote_block(text: str) -> str:
    if '"""' in text:
        raise ExportError('text containing """ cannot be written into a Modelfile')
    return '"""' + text + '"""'


def build_modelfile(gguf_name: str, template: str | None, stops: list[str],
                    system: str | None) -> str:
    """The Modelfile text (FROM is relative to the Modelfile's folder)."""
    lines = [f"FROM ./{gguf_name}"]
    if template:
        lines.append("TEMPLATE " + _quote_block(template))
    for s in stops:
        lines.append("PARAMETER stop " + json.dumps(s, ensure_ascii=False))
    if system:
        lines.append("SYSTEM " + _quote_block(system))
    return "\n".join(lines) + "\n"


def check_template(lay: ChatLayout, jinja: str, special: dict, bos_text: str,
                   conversations: list[list[dict]], **extra) -> dict:
    """Execute the Go template on each conversation and compare with the Jinja rendering."""
    from .chat import reference_messages, render

    gt = go_template(lay, bos_text)
    for msgs in conversations:
        want = render(jinja, reference_messages(lay, msgs), True, special, **extra)
        if bos_text and want.startswith(bos_text):
            want = want[len(bos_text):]
        got = execute(gt, ollama_values(msgs))
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b),
                      min(len(want), len(got)))
            return {"passed": False, "check": "template", "first_mismatch": at,
                    "expected": want[max(0, at - 40):at + 40],
                    "got": got[max(0, at - 40):at + 40]}
    return {"passed": True, "check": "template", "conversations": len(conversations)}


def create_command(model_name: str, folder: Path | None = None) -> str:
    """The shell command that creates the model, run in the folder holding the downloaded GGUF
    and Modelfile (``folder`` is accepted for compatibility and not used: it is a server path)."""
    return f"ollama create {shlex.quote(model_name)} -f Modelfile"


def _conn(url: str, timeout: float):
    u = urllib.parse.urlsplit(url)
    cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    return cls(u.hostname, u.port or (443 if u.scheme == "https" else 80), timeout=timeout), \
        u.path.rstrip("/")


def push(url: str, model_name: str, gguf_path: Path, template: str | None, stops: list[str],
         system: str | None, progress: ProgressFn = noop_progress,
         timeout: float = 30.0) -> dict:
    """Create ``model_name`` on the Ollama server at ``url``.

    Returns ``{"created": True, "model", "digest", "status"}``; when the server cannot be
    reached, ``{"created": False, "reason", "command"}`` (the caller offers the files).
    Raises :class:`ExportError` when the server answers with an error.
    """
    gguf_path = Path(gguf_path)
    digest = "sha256:" + sha256_file(gguf_path)
    manual = create_command(model_name, gguf_path.parent)
    try:
        conn, base = _conn(url, timeout)
        conn.request("HEAD", f"{base}/api/blobs/{digest}")
        resp = conn.getresponse()
        resp.read()
        if resp.status != 200:
            size = gguf_path.stat().st_size
            conn.putrequest("POST", f"{base}/api/blobs/{digest}")
            conn.putheader("Content-Length", str(size))
            conn.putheader("Content-Type", "application/octet-stream")
            conn.endheaders()
            sent = 0
            with open(gguf_path, "rb") as f:
                for block in iter(lambda: f.read(CHUNK), b""):
                    conn.send(block)
                    sent += len(block)
                    progress("upload", 0.9 * sent / max(size, 1))
            resp = conn.getresponse()
            body = resp.read().decode("utf-8", "replace")
            if resp.status not in (200, 201):
                raise ExportError(f"Ollama refused the blob upload ({resp.status}): {body}")
        progress("create", 0.92)
        payload = {"model": model_name, "files": {gguf_path.name: digest}, "stream": True}
        if template:
            payload["template"] = template
        if system:
            payload["system"] = system
        if stops:
            payload["parameters"] = {"stop": stops}
        conn.request("POST", f"{base}/api/create", body=json.dumps(payload).encode(),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        status = None
        for line in resp:
            if not line.strip():
                continue
            msg = json.loads(line)
            if "error" in msg:
                raise ExportError(f"Ollama could not create {model_name}: {msg['error']}")
            status = msg.get("status", status)
        if resp.status != 200 or status != "success":
            raise ExportError(f"Ollama create ended with HTTP {resp.status}, status {status!r}")
        conn.close()
    except (OSError, http.client.HTTPException) as e:
        return {"created": False, "reason": f"Ollama at {url} is not reachable: {e}",
                "command": manual, "digest": digest}
    progress("create", 1.0)
    return {"created": True, "model": model_name, "digest": digest, "status": status,
            "command": manual}

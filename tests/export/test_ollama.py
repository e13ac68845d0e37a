"""Modelfile TEMPLATE vs transformers' apply_chat_template, and creation over Ollama's API.

Coverage, honestly: the TEMPLATE is executed by our own evaluator of the Go template subset we
emit (worker.export.gotemplate), with Ollama's data shape (.System, collated .Messages); Go's
text/template itself is not run here. Conversations: 30 real OASST multi-turn rows (2 and 4
turns, contents stripped) with a system prompt, ending on a user turn, generation prompt on.
Gemma-2 rejects a system role, so there the system prompt is compared merged into the first
user turn. A leading BOS text is left out of the TEMPLATE (llama.cpp adds BOS as a token).
"""
from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.export.conftest import DATA, need_data
from worker.export.chat import derive_layout, reference_messages
from worker.export.gotemplate import execute, go_template, ollama_values
from worker.export.ollama import build_modelfile, push

TEMPLATES = sorted((DATA / "chat_templates").glob("*.jinja"))
SPECIAL = ["<|eot_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>", "</s>",
           "<｜end▁of▁sentence｜>", "<|endoftext|>", "<|begin_of_text|>", "<s>", "<bos>"]
BOS = {"meta-llama": "<|begin_of_text|>", "google": "<bos>", "deepseek":
       "<｜begin▁of▁sentence｜>"}


def _conversations(n=30):
    rows = [json.loads(l) for l in (DATA / "sft" / "oasst1_en_100_messages.jsonl").open()][:n]
    out = []
    for r in rows:
        msgs = [{"role": m["role"], "content": m["content"].strip()} for m in r["messages"]]
        out.append([{"role": "system", "content": "You are a careful assistant."}] + msgs[:-1])
    return out


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.stem)
def test_template_matches_jinja_byte_for_byte(path: Path):
    need_data()
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    bos = next((v for k, v in BOS.items() if path.stem.startswith(k)), "<s>")
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), bos_token=bos,
                                  eos_token="</s>")
    tok.chat_template = path.read_text()
    special = {"bos_token": bos, "eos_token": "</s>"}
    lay = derive_layout(tok.chat_template, special, SPECIAL, date_string="26 Jul 2024")
    gt = go_template(lay, bos)
    convs = _conversations()
    for msgs in convs + [[m for m in c if m["role"] != "system"] for c in convs[:5]]:
        want = tok.apply_chat_template(reference_messages(lay, msgs), tokenize=False,
                                       add_generation_prompt=True, date_string="26 Jul 2024")
        want = want[len(bos):] if want.startswith(bos) else want
        assert execute(gt, ollama_values(msgs)) == want
    assert lay.stops, "an end-of-turn stop string is expected"


def test_evaluator_semantics():
    t = '{{- if .System }}[{{ .System }}]{{ else }}none{{ end -}}\n {{ range $i, $m := .Messages }}' \
        '{{ $last := eq (len (slice $.Messages $i)) 1 }}{{ .Role }}{{ if not $last }},{{ end }}{{ end }}'
    assert execute(t, {"System": "", "Messages": [{"Role": "a"}, {"Role": "b"}]}) == "nonea,b"
    assert execute('{{ "{{" }}x', {}) == "{{x"


def test_modelfile_text():
    mf = build_modelfile("m-Q8_0.gguf", "{{ .Prompt }}", ["</s>", '"q"'], "Be nice.")
    assert mf.splitlines() == ["FROM ./m-Q8_0.gguf", 'TEMPLATE """{{ .Prompt }}"""',
                               'PARAMETER stop "</s>"', 'PARAMETER stop "\\"q\\""',
                               'SYSTEM """Be nice."""']


class _Ollama(BaseHTTPRequestHandler):
    blobs: dict = {}
    creates: list = []

    def log_message(self, *a):
        pass

    def do_HEAD(self):
        self.send_response(200 if self.path.rsplit("/", 1)[-1] in self.blobs else 404)
        self.end_headers()

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path.startswith("/api/blobs/"):
            digest = self.path.rsplit("/", 1)[-1]
            ok = digest == "sha256:" + hashlib.sha256(body).hexdigest()
            if ok:
                self.blobs[digest] = len(body)
            self.send_response(201 if ok else 400)
            self.end_headers()
            return
        req = json.loads(body)
        self.creates.append(req)
        self.send_response(200)
        self.end_headers()
        missing = [d for d in req["files"].values() if d not in self.blobs]
        lines = [{"status": "parsing GGUF"}] + (
            [{"error": f"missing blob {missing}"}] if missing else [{"status": "success"}])
        self.wfile.write(b"".join(json.dumps(x).encode() + b"\n" for x in lines))


def test_push_to_local_server(tmp_path):
    gguf = tmp_path / "m-Q8_0.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 50)
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Ollama)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    seen = []
    try:
        res = push(f"http://127.0.0.1:{srv.server_port}", "stories:latest", gguf,
                   "{{ .Prompt }}", ["</s>"], "Be brief.", lambda s, f: seen.append((s, f)),
                   timeout=10)
    finally:
        srv.shutdown()
    digest = "sha256:" + hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert res["created"] and res["digest"] == digest
    assert _Ollama.blobs[digest] == gguf.stat().st_size
    assert _Ollama.creates[-1] == {"model": "stories:latest", "files": {gguf.name: digest},
                                   "stream": True, "template": "{{ .Prompt }}",
                                   "system": "Be brief.", "parameters": {"stop": ["</s>"]}}
    assert seen and seen[-1] == ("create", 1.0)


def test_unreachable_server_gives_command(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    res = push(f"http://127.0.0.1:{port}", "x", gguf, None, [], None, timeout=2)
    assert res["created"] is False and "not reachable" in res["reason"]
    assert res["command"].endswith("ollama create x -f Modelfile")


def test_end_of_turn_text_is_a_stop_when_no_special_token_holds_it():
    """ChatML on a base model whose vocabulary lacks <|im_end|> (stories260K): the end-of-turn
    text itself is the Ollama stop string; with the token registered it is the token."""
    need_data()
    src = DATA / "chat_templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"  # ChatML
    special = {"bos_token": "<s>", "eos_token": "</s>"}
    assert derive_layout(src.read_text(), special, ["</s>", "<s>"]).stops == ["<|im_end|>"]
    assert derive_layout(src.read_text(), special, SPECIAL).stops == ["<|im_end|>"]

"""Verify an export against the trained model (base + adapter, unmerged) on probe prompts.

Checks, per probe prompt:

* tokenisation: the artifact's tokenizer gives the same ids as the run's HF tokenizer;
* greedy continuation (``max_new_tokens`` = 32, stopping at the model's end ids): identical for
  merged 16-bit, F32/F16/BF16/Q8_0 GGUF (``exact=True``);
* top-1 agreement (all types; the figure shown for K-quants, ``exact=False``): the artifact is fed
  prompt + reference continuation and its argmax is compared with the reference's next token at
  every continuation position (teacher forcing, so one early miss does not count twice).

* logits (merged; F32/F16/BF16/Q8_0 GGUF): along the reference continuation the artifact's logits
  for the reference's top-``TOP_K`` tokens of every step must be within ``LOGIT_TOL[dtype] *
  max(1, |top logit|)`` of the reference's. The reference is base + adapter computed by PEFT's
  own unmerged forward (never by our merge code), so a wrong merge (an output head that took
  the trained embedding, a missing delta) fails here even when greedy tokens happen to agree.

Near ties: a 16-bit or 8-bit artifact cannot reproduce an fp32 model's choice between two tokens
whose logits differ by less than its own rounding error. So when the greedy sequences first
differ at a step where the *reference's* logit margin between its token and the artifact's token
is below ``NEAR_TIE[dtype] * max(1, |top logit|)``, the divergence is accepted and reported
(``near_ties``) rather than failed; the teacher-forced top-1 agreement must then still reach
``MIN_AGREEMENT``. Any other difference fails the check.

llama.cpp runs the GGUF checks with its KV cache in F32 (:func:`_llama`), so a GGUF's figures are
the file's own rounding, not the F16 cache's.

Result: ``{"passed", "checks": [...], "top1_agreement", "failures": [diff, ...]}`` where a diff is
``{"passed": False, "check", "prompt", "expected_tokens", "got_tokens", "first_mismatch"}``.
"""
from __future__ import annotations

import json
from pathlib import Path

MAX_NEW = 32
EXACT_GGUF = ("F32", "F16", "BF16", "Q8_0")
TOP_K = 8
# Relative logit margin under which two tokens are a near tie for an artifact of this precision.
# bf16 keeps 8 mantissa bits: merged bf16 logits of a correctly merged model were seen 0.09-0.16
# away from the fp32 reference at logits around 10 (QA, stories260K), so 2e-2 was too tight.
NEAR_TIE = {"float32": 1e-4, "F32": 1e-4, "float16": 1e-2, "F16": 1e-2,
            "bfloat16": 5e-2, "BF16": 5e-2, "Q8_0": 5e-2}
MIN_AGREEMENT = 0.9
# Relative logit error that rounding to the artifact's precision explains (measured on the test
# models: fp32 ~1e-6, F16 GGUF ~2e-3, bf16 ~1.5e-2, Q8_0 ~1e-2); a wrong merge is far above it.
LOGIT_TOL = {"float32": 1e-3, "F32": 1e-3, "float16": 2e-2, "F16": 2e-2,
             "bfloat16": 6e-2, "BF16": 6e-2, "Q8_0": 6e-2}


def logit_error(tops: list, rows) -> float:
    """Largest ``|artifact - reference| / max(1, |reference top logit|)`` over the reference's
    top-k ``tops`` (``[[id, logit], ...]`` per step) and the artifact's logit ``rows`` (one
    vocab-sized row per step, same positions)."""
    worst = 0.0
    for k, top in enumerate(tops[:len(rows)]):
        scale = max(1.0, abs(top[0][1]))
        for i, v in top:
            worst = max(worst, abs(float(rows[k][int(i)]) - v) / scale)
    return worst


def logit_check(err: float, precision: str) -> tuple[dict, dict | None]:
    """``(summary, failure or None)`` for the largest relative logit error of an artifact."""
    tol = LOGIT_TOL.get(precision)
    note = {"max_logit_error": round(err, 6), "logit_tolerance": tol,
            "rounding": f"{precision}: logits expected within {tol} x max(1, |top logit|) of "
                        "fp32 base + adapter (PEFT)" if tol else f"{precision}: not compared"}
    if tol is None or err <= tol:
        return note, None
    return note, {"passed": False, "check": "logits", "max_logit_error": round(err, 6),
                  "tolerance": tol}


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """Index of the first difference (``min(len)`` when one is a prefix), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def summarize(verification: dict) -> str:
    """One readable line for a failed verification, e.g. ``merged: greedy tokens differ from
    position 14 on 1 of 3 probe prompts (top-1 agreement 0.97)``."""
    parts = []
    for name, c in (verification.get("checks") or {}).items():
        if c.get("passed"):
            continue
        if c.get("error"):  # a GGUF type not written or not verified (worker.jobs.export)
            parts.append(f"{name}: {c['error']}")
            continue
        fails = c.get("failures") or []
        kinds = sorted({f.get("check", "?") for f in fails})
        probes = c.get("probes")
        first = next((f.get("first_mismatch") for f in fails if f.get("first_mismatch") is not None), None)
        bits = [f"{', '.join(kinds) or 'check'} failed"]
        if "greedy" in kinds and first is not None:
            n = sum(f.get("check") == "greedy" for f in fails)
            bits = [f"greedy tokens differ from position {first} on {n} of {probes or '?'} probe prompts"]
        if "tokenization" in kinds:
            bits.append("tokenisation differs")
        if "logits" in kinds:
            f = next(f for f in fails if f.get("check") == "logits")
            bits.append(f"logits differ from base + adapter by {f['max_logit_error']:.3g} "
                        f"(rounding explains {f['tolerance']:.3g})")
        if c.get("top1_agreement") is not None:
            bits.append(f"top-1 agreement {c['top1_agreement']:.2f}")
        parts.append(f"{name}: {'; '.join(bits)}")
    return "; ".join(parts) or "verification failed"


def _diff(check: str, prompt: str, want: list[int], got: list[int]) -> dict:
    return {"passed": False, "check": check, "prompt": prompt, "expected_tokens": want,
            "got_tokens": got, "first_mismatch": first_mismatch(want, got)}


def probe_set(path: str | Path | None, tok, template: str | None, n: int = 3,
              max_chars: int = 200, chat_data: bool | None = None) -> tuple[list[str], bool]:
    """``(prompts, chat)``: up to ``n`` prompts from the run's data file (chat rows rendered with
    the template up to the last user turn + generation prompt; plain text cut at ``max_chars``)
    and whether they are chat renderings (training encodes those without adding special tokens,
    text with them: :attr:`app.data.encode.Prepared.add_special_tokens`). Without the file (its
    dataset was deleted) two built-in prompts stand in, rendered as chat when ``chat_data``
    says the run trained on chat rows (:func:`app.data.formats.is_chat_format`), so that the
    export's BOS (:func:`trained_bos`) is the run's whether or not its data is still there."""
    rows: list = []
    p = Path(path) if path else None
    if p and p.exists():
        text = p.read_text(encoding="utf-8", errors="replace")
        if p.suffix in (".jsonl", ".json"):
            try:
                obj = json.loads(text)
                rows = obj if isinstance(obj, list) else [obj]
            except json.JSONDecodeError:
                rows = [json.loads(l) for l in text.splitlines()[:50] if l.strip()]
        else:
            rows = [b.strip() for b in text.replace("<|endoftext|>", "\n\n").split("\n\n")
                    if b.strip()]
    out: list[str] = []
    chat = False
    for r in rows:
        if len(out) >= n:
            break
        if isinstance(r, str):
            out.append(r[:max_chars])
            continue
        msgs = r.get("messages") or [
            {"role": "user" if c.get("from") in ("human", "user") else "assistant",
             "content": c.get("value", "")} for c in r.get("conversations", [])]
        if not msgs and r.get("instruction"):
            msgs = [{"role": "user", "content": (r["instruction"] + "\n" + r.get("input", ""))
                     .strip()}]
        while msgs and msgs[-1]["role"] != "user":
            msgs = msgs[:-1]
        if msgs and template:
            msgs = [dict(m, content=m["content"][:max_chars]) for m in msgs]
            out.append(tok.apply_chat_template(msgs, chat_template=template, tokenize=False,
                                               add_generation_prompt=True))
            chat = True
        elif msgs:
            out.append(msgs[-1]["content"][:max_chars])
    if out:
        return out, chat
    stand_in = ["Once upon a time", "The little dog"][:n]
    if chat_data and template:
        return [tok.apply_chat_template([{"role": "user", "content": p}], chat_template=template,
                                        tokenize=False, add_generation_prompt=True)
                for p in stand_in], True
    return stand_in, False


def probe_prompts(path: str | Path | None, tok, template: str | None, n: int = 3,
                  max_chars: int = 200) -> list[str]:
    """The prompts of :func:`probe_set`."""
    return probe_set(path, tok, template, n, max_chars)[0]


def trained_bos(tok, template: str | None, chat: bool) -> bool:
    """Whether training put BOS first: for chat rows, whether the template renders the BOS text
    first (the rendering is encoded as is); for text rows, whether the tokenizer adds it. The GGUF's
    ``add_bos_token`` is written from this, so llama.cpp and Ollama (which add BOS as a token and
    drop the template's leading BOS text) see the sequences training saw."""
    if not tok.bos_token:
        return False
    if chat and template:
        from .chat import render

        text = render(template, [{"role": "user", "content": "hi"}], True,
                      {"bos_token": tok.bos_token, "eos_token": tok.eos_token or ""})
        return text.startswith(tok.bos_token)
    return tok("a", add_special_tokens=True)["input_ids"][:1] == [tok.bos_token_id]


def encode(tok, prompt: str, chat: bool | None = None) -> list[int]:
    """HF ids for a prompt as training encoded it: a chat rendering (``chat=True``) as is, its
    BOS (if any) being text of the rendering; plain text (``chat=False``) with the tokenizer's
    special tokens. ``chat=None``: BOS added unless the prompt already starts with it."""
    if chat is None:
        bos = tok.bos_token or "\0"
        return list(tok(prompt, add_special_tokens=not prompt.startswith(bos))["input_ids"])
    return list(tok(prompt, add_special_tokens=not chat)["input_ids"])


#: Below this many parameters a CPU forward runs on one intra-op thread (:func:`cpu_threads`).
SMALL_MODEL_PARAMS = 50_000_000


def cpu_threads(n_params: int) -> int:
    """Intra-op threads for CPU forwards of a model of ``n_params`` parameters: 1 for a small
    model (below :data:`SMALL_MODEL_PARAMS`: each step is well under a millisecond of arithmetic,
    so splitting it only adds thread wake-ups), else the cores this process may use that the
    1-minute load average leaves idle, at least 1. On a loaded 2-core box, torch's default of
    one thread per core made every step of stories260K's greedy decode 20-70x slower (threads
    spinning on a peer that was descheduled)."""
    import os

    if n_params < SMALL_MODEL_PARAMS:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, round((cores or 1) - os.getloadavg()[0])))


class _threads:
    """Context: torch's intra-op threads set to :func:`cpu_threads` for ``model``, restored on
    exit (a no-op for a model on a GPU)."""

    def __init__(self, model):
        import torch

        p = next(model.parameters(), None)
        self.n = None if p is None or p.device.type != "cpu" else \
            cpu_threads(sum(x.numel() for x in model.parameters()))
        self.torch = torch

    def __enter__(self):
        self.old = self.torch.get_num_threads()
        if self.n:
            self.torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        self.torch.set_num_threads(self.old)


def hf_greedy(model, ids: list[int], end_ids: list[int], n: int = MAX_NEW,
              tops: list | None = None, on_step=None) -> list[int]:
    """Greedy continuation (no sampling) of ``ids`` for ``n`` tokens: the prompt is forwarded
    once, then one token per step on the model's KV cache (a model that returns none is
    re-forwarded on the whole sequence); on CPU with :func:`cpu_threads` threads.

    When ``tops`` is a list, the ``TOP_K`` (token id, fp32 logit) pairs of every step are appended.
    ``on_step(k)``, if given, is called after the k-th new token (1-based).
    """
    import torch

    seq = list(ids)
    inp, past = torch.tensor([seq]), None
    with torch.no_grad(), _threads(model):
        for k in range(1, n + 1):
            out = model(inp, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float()
            if tops is not None:
                v, i = torch.topk(logits, min(TOP_K, logits.numel()))
                tops.append([[int(a), float(b)] for a, b in zip(i, v)])
            nxt = int(torch.argmax(logits))
            seq.append(nxt)
            if on_step is not None:
                on_step(k)
            if nxt in end_ids:
                break
            inp = torch.tensor([[nxt]] if past is not None else [seq])
    return seq[len(ids):]


def reference(model, tok, prompts: list[str], end_ids: list[int],
              chat: bool | None = None, on_progress=None) -> list[dict]:
    """``[{"prompt", "chat", "ids", "continuation", "top"}]`` from the trained (unmerged) model;
    ``chat`` as in :func:`encode`. ``on_progress(fraction)``, if given, gets the share of the
    greedy steps (``MAX_NEW`` per prompt) done so far, 0..1."""
    refs, total = [], max(1, len(prompts) * MAX_NEW)
    for j, p in enumerate(prompts):
        tops: list = []
        ids = encode(tok, p, chat)
        step = None if on_progress is None else \
            (lambda k, j=j: on_progress((j * MAX_NEW + k) / total))
        refs.append({"prompt": p, "chat": chat, "ids": ids, "top": tops,
                     "continuation": hf_greedy(model, ids, end_ids, tops=tops, on_step=step)})
        if on_progress is not None:
            on_progress((j + 1) * MAX_NEW / total)
    return refs


def compare_greedy(check: str, ref: dict, got: list[int], precision: str) -> tuple[dict | None, dict | None]:
    """Compare an artifact's greedy tokens with the reference, allowing a near-tie divergence.

    Returns ``(failure diff or None, near-tie note or None)``; see the module docstring.
    """
    want = ref["continuation"]
    at = first_mismatch(want, got)
    if at is None:
        return None, None
    tops = ref.get("top") or []
    if at < len(tops) and at < len(got):
        logits = dict((int(i), v) for i, v in tops[at])
        top = tops[at][0][1]
        floor = tops[at][-1][1]
        margin = top - logits.get(got[at], floor)
        limit = NEAR_TIE.get(precision, 0.0) * max(1.0, abs(top))
        if margin <= limit:
            return None, {"check": check, "prompt": ref["prompt"], "position": at,
                          "margin": round(margin, 6), "limit": round(limit, 6)}
    return _diff(check, ref["prompt"], want, got), None


def hf_teacher_forced_top1(model, ids: list[int], cont: list[int]) -> tuple[int, int, list]:
    """(matches, positions, logit rows): a transformers model's argmax vs the reference next
    token, and its fp32 logits (one row per continuation position)."""
    import torch

    if not cont:
        return 0, 0, []
    with torch.no_grad(), _threads(model):
        logits = model(torch.tensor([ids + cont[:-1]])).logits[0, len(ids) - 1:].float()
    preds = torch.argmax(logits, dim=-1).tolist()
    return sum(int(a) == b for a, b in zip(preds, cont)), len(cont), logits.numpy()


def verify_merged(folder: str | Path, refs: list[dict], end_ids: list[int], tok,
                  on_progress=None) -> dict:
    """Reload the merged folder with transformers and compare with ``refs``;
    ``on_progress(fraction)``, if given, after each probe (0..1)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.hf_attention import attn_kwargs

    model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto",
                                                 **attn_kwargs(folder)).eval()
    precision = str(next(model.parameters()).dtype).removeprefix("torch.")
    mtok = AutoTokenizer.from_pretrained(folder)
    fails, checks, ties, hits, total, err = [], [], [], 0, 0, 0.0
    for k, r in enumerate(refs, 1):
        ids = encode(mtok, r["prompt"], r.get("chat"))
        checks.append("tokenization")
        if ids != r["ids"]:
            fails.append(_diff("tokenization", r["prompt"], r["ids"], ids))
            continue
        h, t, rows = hf_teacher_forced_top1(model, ids, r["continuation"])
        hits, total = hits + h, total + t
        err = max(err, logit_error(r.get("top") or [], rows))
        checks.append("logits")
        checks.append("greedy")
        fail, tie = compare_greedy("greedy", r, hf_greedy(model, ids, end_ids), precision)
        fails += [fail] if fail else []
        ties += [tie] if tie else []
        if on_progress is not None:
            on_progress(k / len(refs))
    agree = hits / total if total else 1.0
    if ties and agree < MIN_AGREEMENT:
        fails.append({"passed": False, "check": "top1_agreement", "top1_agreement": agree,
                      "required": MIN_AGREEMENT})
    note, fail = logit_check(err, precision)
    fails += [fail] if fail else []
    return {"passed": not fails, "checks": sorted(set(checks)), "probes": len(refs),
            "dtype": precision, "top1_agreement": round(agree, 4), "near_ties": ties,
            **note, "failures": fails}


def _llama(path: str | Path, n_ctx: int):
    """llama.cpp on ``path`` for the checks, its KV cache in F32: llama.cpp keeps K and V in F16
    by default, which alone moved an F32 GGUF's logits 1.5e-3 x |top logit| from the reference
    (trial s23: an F32 export failed its 1e-3 check); in F32 they agree exactly, so the checks
    measure the file, not the runtime's cache precision."""
    from llama_cpp import GGML_TYPE_F32, Llama

    return Llama(model_path=str(path), n_ctx=n_ctx, logits_all=True, verbose=False,
                 n_threads=2, n_gpu_layers=0, seed=0, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32)


def gguf_greedy(llm, ids: list[int], end_ids: list[int], n: int = MAX_NEW) -> list[int]:
    """Greedy decoding with llama.cpp (incremental KV cache, argmax of the logits)."""
    import numpy as np

    llm.reset()
    llm.eval(ids)
    out: list[int] = []
    for _ in range(n):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(nxt)
        if nxt in end_ids:
            break
        llm.eval([nxt])
    return out


def teacher_forced_top1(llm, ids: list[int], cont: list[int]) -> tuple[int, int, list]:
    """(matches, positions, logit rows): llama.cpp argmax vs the reference next token along
    ``cont``, and llama.cpp's logits at those positions."""
    import numpy as np

    if not cont:
        return 0, 0, []
    llm.reset()
    llm.eval(ids + cont[:-1])
    rows = np.array(llm.scores[len(ids) - 1:len(ids) + len(cont) - 1])
    preds = np.argmax(rows, axis=-1)
    return int(sum(int(a) == b for a, b in zip(preds, cont))), len(cont), rows


def verify_gguf(path: str | Path, qtype: str, refs: list[dict], end_ids: list[int],
                bos_text: str | None = None) -> dict:
    """Reload a GGUF with llama.cpp and compare with ``refs`` (see the module docstring).

    Prompts are tokenised as llama.cpp's chat path does: with the GGUF's own BOS rule
    (``add_bos_token``), a leading ``bos_text`` of the rendering dropped when that rule adds BOS;
    the ids must equal training's (``refs[i]["ids"]``). Runs llama.cpp in this process: the
    export calls it through :func:`worker.export.llama_child.call`."""
    exact = qtype.upper() in EXACT_GGUF
    n_ctx = max(len(r["ids"]) + MAX_NEW for r in refs) + 8
    llm = _llama(path, n_ctx)
    gguf_bos = bool(llm.tokenize(b"", add_bos=True, special=True))
    fails, ties, hits, total, err = [], [], 0, 0, 0.0
    for r in refs:
        prompt = r["prompt"]
        if gguf_bos and bos_text and prompt.startswith(bos_text):
            prompt = prompt[len(bos_text):]
        ids = llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=True)
        if list(ids) != r["ids"]:
            fails.append(_diff("tokenization", r["prompt"], r["ids"], list(ids)))
            continue
        h, t, rows = teacher_forced_top1(llm, r["ids"], r["continuation"])
        hits, total = hits + h, total + t
        err = max(err, logit_error(r.get("top") or [], rows))
        if exact:
            fail, tie = compare_greedy("greedy", r, gguf_greedy(llm, r["ids"], end_ids),
                                       qtype.upper())
            fails += [fail] if fail else []
            ties += [tie] if tie else []
    llm.close()
    types = tensor_types(path)
    agree = hits / total if total else 1.0
    if ties and agree < MIN_AGREEMENT:
        fails.append({"passed": False, "check": "top1_agreement", "top1_agreement": agree,
                      "required": MIN_AGREEMENT})
    note, fail = logit_check(err, qtype.upper())  # a type without a tolerance: "Q4_K_M: not compared"
    fails += [fail] if fail else []
    return {"passed": not fails, "type": qtype, "exact_greedy_required": exact, **note,
            "top1_agreement": round(agree, 4), "positions": total, "probes": len(refs),
            "near_ties": ties, "tensor_types": types, "note": fallback_note(qtype, types),
            "failures": fails}


def tensor_types(path: str | Path) -> dict[str, int]:
    """How many tensors of each GGML type the GGUF file holds (read with ``gguf.GGUFReader``)."""
    from collections import Counter

    from gguf import GGUFReader

    return dict(Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors).most_common())


def fallback_note(qtype: str, types: dict[str, int]) -> str | None:
    """A warning when llama.cpp wrote none of the requested quant type (e.g. Q6_K asked, but every
    row is too short for a 256-wide K-quant block, so it fell back to Q8_0/Q5_0)."""
    q = qtype.upper()
    family = q.split("_")[0] + "_" + q.split("_")[1] if "_" in q else q
    if q in ("F32", "F16", "BF16") or any(t.startswith(family) for t in types):
        return None
    return (f"no tensor was stored as {q}: llama.cpp fell back to "
            f"{', '.join(t for t in types if t not in ('F32',))} (rows too short for this type)")

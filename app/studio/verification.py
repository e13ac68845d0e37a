"""An export's verification in plain words: what was compared, how well it agreed, and the rule
(threshold) that decided, one sentence per check. The figures come from the worker's result
(``worker.export.verify``); the raw JSON stays available beside the summary.
"""
from __future__ import annotations

from typing import Any

#: The top-1 agreement a check must reach when it accepted near ties (the worker's
#: ``worker.export.verify.MIN_AGREEMENT``; a test keeps the two equal).
NEAR_TIE_MIN_AGREEMENT = 0.9
#: GGUF types whose greedy tokens must equal the trained model's (the worker's ``EXACT_GGUF``).
EXACT_GGUF = ("F32", "F16", "BF16", "Q8_0")


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.0f}%"


def _subject(name: str, check: dict[str, Any]) -> str:
    if name == "adapter":
        return "LoRA adapter, reloaded with PEFT on the base model"
    if name == "merged":
        dtype = check.get("dtype")
        return f"Merged 16-bit{f' ({dtype})' if dtype else ''}, reloaded with transformers"
    if name.startswith("gguf_"):
        return f"GGUF {check.get('type') or name[5:]}, reloaded with llama.cpp"
    return name


def _exact_required(name: str, check: dict[str, Any]) -> bool:
    if "exact_greedy_required" in check:
        return bool(check["exact_greedy_required"])
    return not name.startswith("gguf_") or name[5:].upper() in EXACT_GGUF


def summarize_check(name: str, check: dict[str, Any]) -> str:
    """One sentence for one check (``adapter``, ``merged``, ``gguf_<TYPE>``) of a verification.
    A GGUF type that could not be written or verified (``error``) is said so, with the error;
    one whose file was removed (``removed``: it failed) says so too."""
    removed = " (its file was removed)" \
        if check.get("removed") else ""
    if check.get("error"):
        return f"{_subject(name, check)} — failed: {check['error']}{removed}."
    fails = check.get("failures") or []
    probes = check.get("probes")
    prompts = f"{probes} probe prompt{'s' if probes != 1 else ''}" if probes else "the probe prompts"
    agree = check.get("top1_agreement")
    positions = check.get("positions")
    agreement = (f"top-1 agreement {_pct(agree)}"
                 f"{f' over {positions} token positions' if positions else ''}"
                 if agree is not None else "")
    bits = []
    greedy_fails = [f for f in fails if f.get("check") == "greedy"]
    if _exact_required(name, check):
        rule = f"greedy tokens on {prompts} must equal the trained model's"
        if greedy_fails:
            first = min(f.get("first_mismatch") or 0 for f in greedy_fails)
            bits.append(f"{rule}: they differ on {len(greedy_fails)} (first at token {first})")
        else:
            bits.append(f"{rule}: they do")
        ties = check.get("near_ties") or []
        if ties:
            worst = max(ties, key=lambda t: t.get("margin", 0))
            bits.append(f"{len(ties)} divergence{'s' if len(ties) != 1 else ''} accepted as near "
                        f"ties (logit margin {worst.get('margin')} within the limit "
                        f"{worst.get('limit')}), which requires top-1 agreement of at least "
                        f"{_pct(NEAR_TIE_MIN_AGREEMENT)}")
        if agreement:
            bits.append(agreement)
    else:
        bits.append(f"{agreement or 'top-1 agreement'} on {prompts}, reported only: a "
                    f"{check.get('type') or 'quantized'} file need not reproduce the trained "
                    "model's greedy tokens, so no agreement threshold applies")
    if any(f.get("check") == "tokenization" for f in fails):
        bits.append("its tokenizer gives different token ids")
    low = [f for f in fails if f.get("check") == "top1_agreement"]
    if low:
        bits.append(f"agreement {_pct(low[0].get('top1_agreement'))} is below the required "
                    f"{_pct(low[0].get('required', NEAR_TIE_MIN_AGREEMENT))}")
    verdict = "passed" if check.get("passed") else "failed"
    return f"{_subject(name, check)} — {verdict}: {'; '.join(bits)}{removed}."


def summarize(verification: dict[str, Any] | None) -> list[str]:
    """One sentence per check of an export's ``verification`` (empty when there is none)."""
    if not verification:
        return []
    return [summarize_check(name, c) for name, c in (verification.get("checks") or {}).items()
            if isinstance(c, dict)]

"""Chat generation for the playground: a model loaded once, prompts rendered with the run's chat
template, tokens streamed as they are decoded.

* :func:`load_hf` loads a base model (fp32 on the CPU, bf16/fp16 on CUDA) and, for a run, its
  LoRA adapter (the final ``adapter/`` or a ``checkpoint-<step>/`` folder) with PEFT; the base
  side of the same load is the adapter switched off (PEFT ``disable_adapter()``), so one load
  serves both panes.
* :func:`load_gguf` opens an exported GGUF with llama.cpp (llama-cpp-python), as Ollama would
  serve it.
* :func:`render_prompt` renders the messages with the template the run was created with
  (``add_generation_prompt=True``), exactly as training rendered them (same BOS/EOS strings and
  special-token variables, :mod:`app.data.chat_template`); template ``None`` ("none") sends
  the last user message as is after BOS.
* A :class:`Stream` produces one side's answer one token at a time (:meth:`Stream.step`), so
  the caller can interleave the sides and write text as it comes. Sampling
  (:func:`worker.engine.sampling.warp`, HF's order): the repetition penalty over the prompt and
  the answer so far, then temperature 0 is greedy, else temperature, top-k, top-p, min-p and a
  draw from a seeded generator. llama.cpp gets the same values, its "off" ones explicit (its
  own defaults are top_k 40, min_p 0.05); it applies temperature last and penalizes the tokens
  it generated (the prompt's are not counted). An answer stops at an EOS token id, at an
  end-of-turn marker in its text (:data:`worker.engine.evaluation.END_MARKERS`, which is cut
  off and never streamed), at ``max_tokens`` or at the model's context length.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from worker.engine.evaluation import END_MARKERS


@dataclass
class Params:
    """Sampling parameters of one prompt: ``temperature`` >= 0 (0 = greedy), ``top_p`` in
    (0, 1], ``max_tokens`` >= 1 new tokens, ``seed`` for the draws (None: random),
    ``top_k`` >= 0 (0 = off), ``min_p`` in [0, 1) (0 = off), ``repetition_penalty`` > 0
    (1 = off; applied at temperature 0 too, as HF does)."""

    temperature: float = 0.7
    top_p: float = 1.0
    max_tokens: int = 256
    seed: int | None = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0


@dataclass
class Loaded:
    """A loaded playground model: ``kind`` ``hf`` or ``gguf``; ``model`` the (PEFT) model or
    the ``llama_cpp.Llama``; ``tokenizer`` the HF tokenizer (hf only); ``specials`` the
    template variables (bos_token, eos_token, ...); ``has_adapter`` whether the base side is
    the adapter switched off; ``context`` the longest sequence in tokens."""

    kind: str
    model: Any
    tokenizer: Any = None
    specials: dict[str, str] = field(default_factory=dict)
    has_adapter: bool = False
    context: int = 2048
    device: str = "cpu"


def _specials(model_dir: str) -> dict[str, str]:
    from app.data.encode import load_tokenizer_bundle

    bundle = load_tokenizer_bundle(model_dir)
    return dict(bundle.special_tokens)


def load_hf(model_dir: str, adapter_dir: str | None, cuda: bool) -> Loaded:
    """The base model of ``model_dir`` with the LoRA adapter of ``adapter_dir`` (None: the base
    alone), in eval mode. Raises OSError/ValueError from transformers or PEFT on bad folders."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if cuda:
        kwargs = {"dtype": torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16,
                  "device_map": {"": 0}}
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    if adapter_dir:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    ctx = getattr(model.config, "max_position_embeddings", None) or 2048
    return Loaded("hf", model, tok, _specials(model_dir), bool(adapter_dir), int(ctx),
                  "cuda" if cuda else "cpu")


def load_gguf(path: str, cuda: bool, n_ctx: int = 4096) -> Loaded:
    """An exported GGUF opened with llama.cpp (every layer on the GPU with ``cuda``).
    Raises ValueError when llama.cpp cannot load it."""
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=n_ctx, n_gpu_layers=-1 if cuda else 0, verbose=False,
                logits_all=False, last_n_tokens_size=n_ctx)  # penalize the whole answer
    specials = {}
    for key, tid in (("bos_token", llm.token_bos()), ("eos_token", llm.token_eos())):
        if tid is not None and tid >= 0:
            specials[key] = llm.detokenize([tid], special=True).decode("utf-8", "replace")
    return Loaded("gguf", llm, None, specials, False, llm.n_ctx(), "cuda" if cuda else "cpu")


def render_prompt(loaded: Loaded, messages: list[dict], template: str | None) -> str:
    """The prompt text for ``messages`` (``[{"role", "content"}]``): rendered with
    ``template`` and the generation prompt, or (``template`` None) BOS + the last user
    message. Raises :class:`app.data.errors.DatasetError` when the template rejects them."""
    from app.data.chat_template import render_chat

    bos, eos = loaded.specials.get("bos_token", ""), loaded.specials.get("eos_token", "")
    if template is None:
        last = next((m for m in reversed(messages) if m.get("role") == "user"), messages[-1])
        return bos + str(last.get("content") or "")
    return render_chat(messages, template, bos_token=bos, eos_token=eos,
                       add_generation_prompt=True, special_tokens=loaded.specials)


def prompt_ids(loaded: Loaded, text: str) -> list[int]:
    """Token ids of a rendered prompt, its special tokens parsed and none added (the template
    wrote BOS itself), as training encoded it."""
    if loaded.kind == "gguf":
        return list(loaded.model.tokenize(text.encode("utf-8"), add_bos=False, special=True))
    return list(loaded.tokenizer(text, add_special_tokens=False)["input_ids"])


def _held_back(text: str) -> int:
    """How many trailing characters of ``text`` could start an end-of-turn marker (kept back
    until the next token says whether it is one)."""
    for n in range(min(len(text), max(len(m) for m in END_MARKERS) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in END_MARKERS):
            return n
    return 0


class Stream:
    """One side's answer, a token per :meth:`step` (see the module docstring).

    ``side`` is ``fine_tuned``, ``base`` (the adapter off) or ``gguf``. After each step
    :meth:`take` gives the new text; ``done`` / ``finish_reason`` (``stop`` | ``length``) say
    when it ended; ``completion_tokens``, ``prompt_tokens``, ``first_token_seconds`` (from
    construction) are the usage figures."""

    def __init__(self, loaded: Loaded, side: str, ids: list[int], params: Params):
        self.loaded, self.side, self.params = loaded, side, params
        self.prompt_tokens = len(ids)
        self.generated: list[int] = []
        self.text, self.sent = "", 0
        self.done, self.finish_reason = False, None
        self.started = time.monotonic()
        self.first_token_seconds: float | None = None
        self._budget = max(0, min(params.max_tokens, loaded.context - len(ids)))
        if self._budget == 0:
            self.done, self.finish_reason = True, "length"
        if loaded.kind == "gguf":
            self._it = iter(loaded.model.create_completion(
                prompt=ids, max_tokens=self._budget, temperature=params.temperature,
                top_p=params.top_p, top_k=params.top_k, min_p=params.min_p,
                repeat_penalty=params.repetition_penalty, stream=True,
                stop=list(END_MARKERS), seed=params.seed))
        else:
            self._ids, self._past, self._logits = ids, None, None
            self._seen, self._seen_n = None, 0  # repetition penalty: prompt + answer on device
            import torch

            self._gen = torch.Generator(device=loaded.device)
            self._gen.manual_seed(params.seed if params.seed is not None
                                  else int(time.time_ns() % (2**31)))
            eos = getattr(loaded.model.generation_config, "eos_token_id", None)
            eos = [eos] if isinstance(eos, int) else list(eos or [])
            if loaded.tokenizer.eos_token_id is not None:
                eos.append(loaded.tokenizer.eos_token_id)
            self._eos = set(eos)

    def _context(self):
        if self.side == "base" and self.loaded.has_adapter:
            return self.loaded.model.disable_adapter()
        return contextlib.nullcontext()

    def step(self) -> None:
        """Generate one more token (a chunk for llama.cpp); no-op once done."""
        if self.done:
            return
        if self.loaded.kind == "gguf":
            chunk = next(self._it, None)
            if chunk is None:
                self.done, self.finish_reason = True, self.finish_reason or "stop"
                return
            choice = chunk["choices"][0]
            self._mark_first()
            self.text += choice.get("text") or ""
            if choice.get("finish_reason"):
                self.done, self.finish_reason = True, choice["finish_reason"]
            return
        import torch

        with torch.inference_mode(), self._context():
            model = self.loaded.model
            if self._past is None:
                x = torch.tensor([self._ids], device=self.loaded.device)
            else:
                x = torch.tensor([[self.generated[-1]]], device=self.loaded.device)
            out = model(input_ids=x, past_key_values=self._past, use_cache=True)
            self._past = out.past_key_values
            logits = out.logits[:, -1, :].float()
            tok = self._sample(logits)
        self._mark_first()
        if tok in self._eos:
            self.done, self.finish_reason = True, "stop"
            return
        self.generated.append(tok)
        self.text = self.loaded.tokenizer.decode(self.generated, skip_special_tokens=True)
        for m in END_MARKERS:
            i = self.text.find(m)
            if i >= 0:
                self.text = self.text[:i]
                self.done, self.finish_reason = True, "stop"
        if not self.done and len(self.generated) >= self._budget:
            self.done, self.finish_reason = True, "length"

    def _mark_first(self) -> None:
        if self.first_token_seconds is None:
            self.first_token_seconds = round(time.monotonic() - self.started, 4)

    def _sample(self, logits) -> int:
        import torch

        from worker.engine.sampling import warp

        p = self.params
        greedy = p.temperature <= 0
        cfg = SimpleNamespace(do_sample=not greedy, temperature=p.temperature,
                              top_k=p.top_k or None, top_p=p.top_p, min_p=p.min_p or None,
                              repetition_penalty=p.repetition_penalty)
        ids = self._penalized_ids(logits.device) if p.repetition_penalty != 1.0 \
            else logits.new_zeros((1, 0), dtype=torch.long)
        logits = warp(logits, ids, cfg)
        if greedy:
            return int(logits.argmax(-1))
        probs = logits.softmax(-1)
        return int(torch.multinomial(probs.to(self._gen.device), 1, generator=self._gen))

    def _penalized_ids(self, device):
        """[1, n] long on ``device``: the prompt and the answer so far, the ids the repetition
        penalty counts. One buffer per answer (prompt + token budget) filled as tokens come, so a
        token costs a scalar write, not a host list of every id copied to the device."""
        import torch

        if self._seen is None:
            self._seen = torch.empty((1, len(self._ids) + self._budget), dtype=torch.long,
                                     device=device)
            self._seen[0, :len(self._ids)] = torch.tensor(self._ids, dtype=torch.long)
            self._seen_n = len(self._ids)
        n = len(self._ids) + len(self.generated)
        for tok in self.generated[self._seen_n - len(self._ids):]:
            self._seen[0, self._seen_n] = tok
            self._seen_n += 1
        return self._seen[:, :n]

    def take(self) -> str:
        """The text decoded since the last call, less an unfinished character or a possible
        start of an end-of-turn marker (both follow once settled; all of it once done)."""
        end = len(self.text)
        if not self.done:
            if self.text.endswith("\ufffd"):
                end -= 1
            end -= _held_back(self.text[:end])
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:end], end
        return out

    @property
    def completion_tokens(self) -> int:
        """Tokens generated (llama.cpp: the answer's text tokenized again, as its stream
        carries text, not ids)."""
        if self.loaded.kind == "gguf":
            return len(self.loaded.model.tokenize(self.text.encode("utf-8"), add_bos=False,
                                                  special=False)) if self.text else 0
        return len(self.generated)

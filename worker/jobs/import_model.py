"""The ``import_model`` job (payload ``{"spec_version": 1, "model_id": ...}``).

Makes a registered model ready by writing a Hugging Face folder under
``<data_dir>/models/<name>`` (written to a temporary folder, then renamed):

* ``llama2c``: ``source_ref`` is ``"<checkpoint.bin>|<tokenizer.bin>"``; either part may be
  ``hf://<owner>/<repo>/<file>`` to download it with ``hf_hub_download`` first;
* ``local``: a HF folder on this machine, validated and copied;
* ``hf``: a Hub id (optionally ``id@revision``), fetched with ``snapshot_download``.

On success the model row gets ``status=ready``, ``path``, ``chat_template`` and ``info``
(params, layers, vocab, max_position_embeddings, has_chat_template, ...); on failure
``status=failed`` with the error, and the job fails with the same message.
"""
from __future__ import annotations

import json
import logging
import shutil
import struct
from pathlib import Path
from typing import Any

from app.store import repo
from app.store.specs import ImportModelSpec
from worker.context import JobContext, JobError

log = logging.getLogger("worker.import_model")
WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")


def _hf_errors() -> tuple[type[BaseException], ...]:
    errs: list[type[BaseException]] = [OSError, ConnectionError]
    try:
        from huggingface_hub import errors

        errs += [errors.HfHubHTTPError, errors.LocalEntryNotFoundError]
    except Exception:  # noqa: BLE001
        pass
    return tuple(errs)


def _download_file(ref: str, cache: Path) -> Path:
    """``hf://owner/repo/path/in/repo`` -> local file (cached under ``cache``)."""
    from huggingface_hub import hf_hub_download

    owner, name, filename = ref[len("hf://"):].split("/", 2)
    try:
        return Path(hf_hub_download(f"{owner}/{name}", filename, cache_dir=str(cache)))
    except _hf_errors() as e:
        raise JobError(f"could not download {filename} from the Hugging Face Hub repo "
                       f"{owner}/{name} (is this machine offline? set WHETSTONE_SEED_DIR to a "
                       f"local copy): {' '.join(str(e).split())[:300]}") from e


def _safetensors_params(folder: Path) -> int | None:
    total = 0
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    for f in files:
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for k, v in header.items():
            if k != "__metadata__":
                size = 1
                for d in v["shape"]:
                    size *= d
                total += size
    return total


def validate_hf_folder(folder: Path) -> dict[str, Any]:
    """Check a HF causal-LM folder; return its model info. Raises JobError naming what's missing."""
    cfg_path = folder / "config.json"
    if not folder.is_dir():
        raise JobError(f"{folder} is not a folder")
    if not cfg_path.is_file():
        raise JobError(f"{folder} has no config.json; is it a Hugging Face model folder?")
    if not any(folder.glob(g) for g in WEIGHT_GLOBS):
        raise JobError(f"{folder} has no weights (*.safetensors or pytorch_model*.bin)")
    if not ((folder / "tokenizer.json").is_file()
            or ((folder / "vocab.json").is_file() and (folder / "merges.txt").is_file())):
        raise JobError(f"{folder} has no tokenizer.json (or vocab.json + merges.txt)")
    cfg = json.loads(cfg_path.read_text("utf-8"))
    text_cfg = cfg.get("text_config") or cfg
    from app.data.encode import load_tokenizer_bundle

    bundle = load_tokenizer_bundle(folder)
    info = {
        "architecture": (cfg.get("architectures") or [cfg.get("model_type", "?")])[0],
        "model_type": cfg.get("model_type"),
        "params": _safetensors_params(folder),
        "layers": text_cfg.get("num_hidden_layers"),
        "hidden_size": text_cfg.get("hidden_size"),
        "vocab": text_cfg.get("vocab_size"),
        # the shape app.studio.estimate needs for a run's GPU memory
        **{k: text_cfg.get(k) for k in ("intermediate_size", "num_attention_heads",
                                        "num_key_value_heads", "head_dim")},
        "tie_word_embeddings": bool(text_cfg.get("tie_word_embeddings",
                                                 cfg.get("tie_word_embeddings", False))),
        "max_position_embeddings": text_cfg.get("max_position_embeddings"),
        "has_chat_template": bundle.chat_template is not None,
        "bos_token": bundle.bos_token, "eos_token": bundle.eos_token,
    }
    return {"info": info, "chat_template": bundle.chat_template}


def _build(ctx: JobContext, model, tmp: Path) -> dict[str, Any]:
    settings = ctx.settings
    if model.source == "llama2c":
        parts = model.source_ref.split("|")
        if len(parts) != 2:
            raise JobError("a llama2c source_ref must be '<checkpoint.bin>|<tokenizer.bin>'")
        files = []
        for i, p in enumerate(parts):
            ctx.progress("download", i, 2)
            if p.startswith("hf://"):
                files.append(_download_file(p, settings.data_dir / "models" / ".hf-cache"))
            else:
                files.append(Path(p).expanduser())
            if not files[-1].is_file():
                raise JobError(f"file not found: {files[-1]}")
        ctx.check()
        ctx.progress("convert", 0, 1, "converting the llama2.c checkpoint")
        from worker.engine.llama2c import Llama2cFormatError, convert

        try:
            llama_info = convert(files[0], files[1], tmp)
        except Llama2cFormatError as e:
            raise JobError(str(e)) from None  # the cause would quote file bytes
        out = validate_hf_folder(tmp)
        out["info"].update(llama_info)
        return out
    if model.source == "local":
        src = Path(model.source_ref).expanduser()
        validate_hf_folder(src)
        ctx.progress("copy", 0, 1, f"copying {src}")
        shutil.copytree(src, tmp, ignore=shutil.ignore_patterns(".git", ".cache"))
        return validate_hf_folder(tmp)
    if model.source == "hf":
        from huggingface_hub import snapshot_download

        repo_id, _, revision = model.source_ref.partition("@")
        ctx.progress("download", 0, 1, f"downloading {repo_id} from the Hugging Face Hub")
        try:
            snapshot_download(repo_id, revision=revision or None, local_dir=str(tmp),
                              allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt",
                                              "*.jinja", "tokenizer*"])
        except _hf_errors() as e:
            raise JobError(f"could not download {repo_id} from the Hugging Face Hub (is this "
                           f"machine offline?): {' '.join(str(e).split())[:300]}") from e
        shutil.rmtree(tmp / ".cache", ignore_errors=True)
        return validate_hf_folder(tmp)
    raise JobError(f"unknown model source {model.source!r} (hf | local | llama2c)")


def content_free_error(exc: Exception, model) -> Exception:
    """The error to show for a failed import: ``exc`` itself when its message is ours
    (:class:`JobError`, which never quotes file content) or the operating system's (OSError:
    the reason and the path); otherwise a :class:`JobError` naming only the exception type, since
    a parser's message may quote bytes of the file (the full error goes to the worker log)."""
    if isinstance(exc, (JobError, OSError)):
        return exc
    log.warning("import of model %s failed", model.name, exc_info=exc)
    return JobError(f"{model.source} model {model.name!r} could not be read ({type(exc).__name__}; "
                    "the files are not a model this importer understands; details are in the "
                    "worker log)")


def run(ctx: JobContext) -> dict[str, Any]:
    spec = ImportModelSpec.model_validate(ctx.payload)
    model = repo.get_model(ctx.engine, spec.model_id)
    models_dir = (ctx.settings.data_dir / "models").resolve()
    models_dir.mkdir(parents=True, exist_ok=True)
    final = models_dir / model.name
    tmp = models_dir / f".{model.name}.tmp-{ctx.job.id}"
    shutil.rmtree(tmp, ignore_errors=True)
    ctx.log(f"importing {model.name} ({model.source}: {model.source_ref})")
    try:
        built = _build(ctx, model, tmp)
        ctx.check()
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception):
            safe = content_free_error(e, model)
            repo.update_model(ctx.engine, model.id, status="failed", error=str(safe)[:2000])
            if safe is not e:
                raise safe from None
        raise
    info = built["info"]
    repo.update_model(ctx.engine, model.id, status="ready", path=str(final), error=None,
                      chat_template=built["chat_template"], info=info)
    ctx.progress("done", 1, 1)
    ctx.log(f"{model.name} is ready: {info.get('params')} parameters, {info.get('layers')} layers, "
            f"vocab {info.get('vocab')}, chat template: "
            f"{'yes' if info.get('has_chat_template') else 'none (choose a default per run)'}")
    return {"model_id": model.id, "path": str(final), **info}

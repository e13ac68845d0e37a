"""Job handler for kind ``export``: payload = ExportSpec (+ ``export_id``) -> files + verification.

``export_run`` does the work and is independent of the queue; ``run_export`` adapts it to the
worker loop (payload dict in, result dict out, progress through a callback). Files land in
``<out_dir>/`` (written to temp names and renamed, so a retried job simply redoes them):

* adapter      -> ``adapter/``                      (PEFT folder, tokenizer, chat template)
* merged_16bit -> ``merged-<dtype>/``               (safetensors, config, tokenizer; bf16 or
  fp16: the base's own when 16-bit, bf16 for an fp32 base, fp32 only when asked; the log
  says which and why, :func:`worker.export.merged.merged_dtype`)
* gguf         -> ``<name>-<TYPE>.gguf`` per requested type (default F16)
* ollama       -> ``<name>-<TYPE>.gguf`` + ``Modelfile`` (+ creation on a server if a URL is given)

GGUF types are written and verified one by one: a type that fails to quantise or to verify is
a failed check (``{"passed": False, "type", "error"?, "removed": True}``) whose file is removed,
and the types that passed are kept (the export still fails, with the kept files in
:class:`VerificationFailed`'s ``result["files"]``). Only when no type was written does the first
type's error end the export as before.

Result: ``{"format", "files": [{"name","path","size","sha256"}], "verification": {"passed",
...}, "ollama": {...}}``. A failed verification raises :class:`VerificationFailed`, whose
``result`` holds the same dict with the diffs (store it as the job's result and error).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from worker.export.files import ExportError, describe_files, noop_progress

DEFAULT_OLLAMA_TYPE = "Q8_0"


class VerificationFailed(ExportError):
    """The artifact was written but does not reproduce the trained model; see ``result``."""

    def __init__(self, message: str, result: dict):
        super().__init__(message)
        self.result = result


def _spec(spec) -> dict:
    return spec.model_dump() if hasattr(spec, "model_dump") else dict(spec)


def _end_ids(model, eot: list[tuple[str, int]]) -> list[int]:
    gc = getattr(model, "generation_config", None)
    ids = getattr(gc, "eos_token_id", None) if gc else None
    ids = [] if ids is None else list(ids) if isinstance(ids, (list, tuple)) else [ids]
    return list(dict.fromkeys([*ids, *(i for _, i in eot)]))


def export_run(run_dir: str | Path, spec, out_dir: str | Path,
               progress: Callable[[str, float], None] = noop_progress, *,
               base_dir: str | Path | None = None, data_path: str | Path | None = None,
               ollama_url: str | None = None, model_name: str | None = None,
               name: str = "model", run_spec: dict | None = None,
               base: dict | None = None, llama_timeout: float | None = None,
               data_format: str | None = None) -> dict:
    """Export one run; see the module docstring. ``run_spec`` (the run row's spec), with
    ``base_dir`` and ``data_path`` from the model and dataset rows, is what the export job
    passes; without them the run folder's config.json is read. ``base`` (the model row's
    ``name``, ``source``, ``source_ref``) names the base in the result's ``provenance``.
    ``llama_timeout``: seconds one llama.cpp step may take (None: the setting
    ``llama_cpp_timeout_seconds``; :func:`worker.export.llama_child.call`). ``data_format``: the
    training data's format (the dataset row's, or the spec's ``dataset_format``), which says
    whether the run trained on chat renderings when its data file is gone.
    Raises ExportError / VerificationFailed."""
    import torch

    from worker.export import verify as V
    from worker.export.merged import end_of_turn_tokens
    from worker.export.provenance import provenance
    from worker.export.run import load_run, load_tokenizer, load_trained_model

    s = _spec(spec)
    fmt, out = s["format"], Path(out_dir)
    info = load_run(run_dir, base_dir, run_spec, s.get("checkpoint_step"))
    tok = load_tokenizer(info)
    progress("reference", 0.02)
    trained = load_trained_model(info, dtype=torch.float32)
    eot = end_of_turn_tokens(tok, info.chat_template)
    end_ids = _end_ids(trained, eot)
    ds = info.config.get("dataset")
    data_path = data_path or (ds.get("path") if isinstance(ds, dict) else None) \
        or info.config.get("dataset_path")
    from app.data.formats import is_chat_format

    prompts, chat = V.probe_set(data_path, tok, info.chat_template,
                                chat_data=is_chat_format(data_format) if data_format else None)
    refs = V.reference(trained, tok, prompts, end_ids, chat,
                       lambda f: progress("reference", 0.02 + 0.08 * f))
    add_bos = V.trained_bos(tok, info.chat_template, chat)  # GGUF/Ollama BOS = training's
    files: list[Path] = []
    result: dict[str, Any] = {"format": fmt, "probes": [r["prompt"] for r in refs],
                              "provenance": provenance(info, base, s.get("run_id"))}
    checks: dict[str, dict] = {}

    if fmt == "adapter":
        from peft import PeftModel

        from worker.export.adapter import export_adapter
        from worker.export.run import load_base

        res = export_adapter(info, out / "adapter", lambda st, f: progress(st, 0.1 + 0.1 * f))
        files.append(out / "adapter")
        reloaded = PeftModel.from_pretrained(load_base(info), out / "adapter").eval()
        fails = [V._diff("greedy", r["prompt"], r["continuation"], got)
                 for j, r in enumerate(refs)
                 if (got := V.hf_greedy(reloaded, r["ids"], end_ids, on_step=lambda k, j=j: progress(
                     "verify adapter", 0.2 + 0.8 * (j * V.MAX_NEW + k) / (len(refs) * V.MAX_NEW))))
                 != r["continuation"]]
        checks["adapter"] = {"passed": not fails, "peft": res, "failures": fails}
    elif fmt == "merged_16bit":
        from worker.export.merged import export_merged, merged_dtype

        dtype = merged_dtype(info.base_dir, s.get("dtype"))[0]
        folder = out / f"merged-{dtype}"
        result["merged"] = export_merged(info, folder, s.get("dtype"),
                                         lambda st, f: progress(st, 0.1 + 0.6 * f),
                                         result["provenance"])
        files.append(folder)
        progress("verify merged", 0.7)
        checks["merged"] = V.verify_merged(folder, refs, end_ids, tok,
                                           lambda f: progress("verify merged", 0.7 + 0.3 * f))
        checks["merged"]["dtype_rounding"] = result["merged"]["rounding"]
    elif fmt in ("gguf", "ollama"):
        from worker.export.gguf_writer import BASE_TYPES, write_gguf
        from worker.export.llama_child import call as llama_call

        types = [q.upper() for q in s.get("quantization") or []] or (
            ["F16"] if fmt == "gguf" else [DEFAULT_OLLAMA_TYPE])
        from worker.export.merged import merge_adapter

        merged, result["untied_embeddings"] = merge_adapter(trained)
        state, config = merged.state_dict(), merged.config
        eot_id = next((i for _, i in eot if i != tok.eos_token_id), None)
        kw = dict(chat_template=info.chat_template, eot_id=eot_id,
                  tokenizer_dir=info.tokenizer_dir, name=name, add_bos=add_bos,
                  provenance=result["provenance"])
        f16 = out / f"{name}-F16.gguf"
        written: list[tuple[str, Path]] = []
        first_error: ExportError | None = None
        for k, q in enumerate(types):  # each type on its own: one that fails keeps the others
            path = out / f"{name}-{q}.gguf"
            progress(f"gguf {q}", 0.1 + 0.6 * k / len(types))
            try:
                if q in BASE_TYPES:
                    write_gguf(state, config, tok, path, q, **kw)
                else:
                    if not f16.exists():
                        write_gguf(state, config, tok, f16, "F16", **kw)
                    llama_call("quantize", {"f16_path": str(f16), "out_path": str(path),
                                            "qtype": q}, f"quantising {path.name}",
                               llama_timeout, on_wait=lambda q=q: progress(f"gguf {q}", 0.7))
            except ExportError as e:
                first_error = first_error or e
                path.unlink(missing_ok=True)
                checks[f"gguf_{q}"] = {"passed": False, "type": q, "error": f"not written: {e}"}
                continue
            written.append((q, path))
        if not written:
            raise first_error  # nothing to keep: the export fails as the first type did
        for q, path in written:
            progress(f"verify {q}", 0.75)
            try:
                checks[f"gguf_{q}"] = llama_call(
                    "verify_gguf", {"path": str(path), "qtype": q, "refs": refs,
                                    "end_ids": end_ids, "bos_text": tok.bos_token},
                    f"verifying {path.name}", llama_timeout,
                    on_wait=lambda q=q: progress(f"verify {q}", 0.75))
            except ExportError as e:
                checks[f"gguf_{q}"] = {"passed": False, "type": q, "error": f"not verified: {e}"}
        kept = [(q, p) for q, p in written if checks[f"gguf_{q}"].get("passed")]
        for q, path in written:
            if (q, path) not in kept:  # a file that does not reproduce the run is not offered
                path.unlink(missing_ok=True)
                checks[f"gguf_{q}"]["removed"] = True
        if "F16" not in [q for q, _ in kept] and f16.exists():
            f16.unlink()
        files.extend(p for _, p in kept)
        if fmt == "ollama" and kept:  # the first requested type that passed
            result["ollama"] = _ollama(info, tok, kept[0][1], out, checks, ollama_url,
                                       model_name or name, progress, add_bos)
            files.append(out / "Modelfile")
    else:
        raise ExportError(f"unknown export format {fmt!r}")

    result["files"] = describe_files(files, out)
    result["verification"] = {"passed": all(c.get("passed") for c in checks.values()),
                              "checks": checks}
    if not result["verification"]["passed"]:
        failed = [k for k, c in checks.items() if not c.get("passed")]
        raise VerificationFailed(f"export verification failed: {', '.join(failed)}", result)
    progress("done", 1.0)
    return result


def _ollama(info, tok, gguf_path: Path, out: Path, checks: dict, url, model_name, progress,
            add_bos: bool):
    from worker.export.gotemplate import go_template
    from worker.export.merged import chat_layout
    from worker.export.ollama import build_modelfile, check_template, create_command, push

    lay = chat_layout(tok, info.chat_template)
    template, stops = None, []
    if lay is not None:
        bos = tok.bos_token if add_bos else ""  # llama.cpp adds it as a token
        template, stops = go_template(lay, bos or ""), lay.stops
        sysmsg = [{"role": "system", "content": info.system_prompt or "You are helpful."}]
        convs = [sysmsg + [{"role": "user", "content": "Hi"}],
                 sysmsg + [{"role": "user", "content": "Hi"}, {"role": "assistant",
                            "content": "Hello!"}, {"role": "user", "content": "A story?"}],
                 [{"role": "user", "content": "No system prompt here."}]]
        special = {"bos_token": tok.bos_token or "", "eos_token": tok.eos_token or ""}
        checks["ollama_template"] = check_template(lay, info.chat_template, special, bos or "",
                                                   convs)
    (out / "Modelfile").write_text(build_modelfile(gguf_path.name, template, stops,
                                                   info.system_prompt))
    # file names as the export's files list them: a record shown to members holds no server path
    res = {"modelfile": "Modelfile", "gguf": gguf_path.name,
           "command": create_command(model_name, out), "created": False}
    if url:
        res.update(push(url, model_name, gguf_path, template, stops, info.system_prompt,
                        progress))
    return res


def run_export(payload: dict, *, export_id: str, run_dir: str | Path, out_dir: str | Path,
               progress: Callable[[str, float], None] = noop_progress, **kw) -> dict:
    """Queue-independent entry: ``payload`` is an ExportSpec dict (``export_id`` ignored)."""
    from app.store.specs import ExportSpec

    spec = ExportSpec.model_validate({k: v for k, v in payload.items() if k != "export_id"})
    res = export_run(run_dir, spec, Path(out_dir) / export_id, progress, **kw)
    res["export_id"] = export_id
    return res


def run(ctx) -> dict:
    """Worker-loop handler (``HANDLERS["export"] = "worker.jobs.export:run"``).

    Payload: ExportSpec fields (+ optional ``export_id``, ``ollama_url``, ``model_name``).
    Files go to ``<data_dir>/exports/<export_id or job id>/``; each becomes an Artifact of kind
    ``spec.format`` with size and sha256. A cancel (checked at every progress step; a llama.cpp
    child is killed) removes that folder and those artifacts. A failed verification raises JobError with the first
    diff; the full result (diffs included) is logged as an event ``verification``.
    """
    from app.store import repo
    from app.store.schema import Artifact
    from app.studio.artifacts import portable_text, without_server_paths
    from worker.context import JobError

    payload = dict(ctx.payload)
    export_id = str(payload.pop("export_id", None) or f"export-{ctx.job.id}")
    url = payload.pop("ollama_url", None) or getattr(ctx.settings, "ollama_url", None) or None
    model_name = payload.pop("model_name", None)
    from app.store.specs import ExportSpec

    spec = ExportSpec.model_validate(payload)
    run_row = repo.get_run(ctx.engine, spec.run_id)
    run_dir = Path(run_row.output_dir or ctx.settings.data_dir / "runs" / spec.run_id)
    out = (ctx.settings.data_dir / "exports" / export_id).resolve()

    def undo() -> None:  # a cancelled export leaves no folder and no artifact behind
        import shutil

        repo.delete_job_artifacts(ctx.engine, ctx.job.id)
        shutil.rmtree(out, ignore_errors=True)

    ctx.on_cancel(undo)

    def progress(stage: str, frac: float) -> None:
        ctx.check()
        ctx.progress(stage, round(frac * 1000), 1000)

    model_row = repo.get_model(ctx.engine, run_row.model_id)
    try:
        ds_row = repo.get_dataset(ctx.engine, run_row.dataset_id, deleted=True)
    except repo.NotFound:
        ds_row = None
    # a deleted dataset's file is gone: verification probes with built-in prompts, rendered as
    # the run trained (chat or text, from its format), so the GGUF's BOS is the same either way
    data_path = ds_row.path if ds_row is not None and ds_row.status != repo.DELETED else None
    data_format = (run_row.spec or {}).get("dataset_format") or (ds_row.format if ds_row else None)

    def portable(msg: str) -> str:
        # the job's error is what /api/exports and the run page show: no server path in it
        # (the base's folder is named as the model; a path in the data dir, relative to it)
        msg = portable_text(msg, [model_row.path or ""], model_row.name)
        for root in sorted({str(ctx.settings.data_dir), str(ctx.settings.data_dir.resolve())},
                           key=len, reverse=True):
            msg = msg.replace(root.rstrip("/") + "/", "")
        return msg

    def keep(files: list[dict]) -> None:
        for f in files:
            repo.add_artifact(ctx.engine, Artifact(
                run_id=spec.run_id, job_id=ctx.job.id, kind=spec.format, name=f["name"],
                path=f["path"], bytes=f["size"], sha256=f["sha256"],
                meta={"export_id": export_id, "quantization": spec.quantization}))

    try:
        res = export_run(run_dir, spec, out, progress, ollama_url=url if spec.format == "ollama"
                         else None, model_name=model_name, name=spec.run_id,
                         base_dir=model_row.path, data_path=data_path, run_spec=run_row.spec,
                         base={"name": model_row.name, "source": model_row.source,
                               "source_ref": model_row.source_ref},
                         llama_timeout=getattr(ctx.settings, "llama_cpp_timeout_seconds", None),
                         data_format=data_format)
    except VerificationFailed as e:
        from worker.export.verify import summarize

        # the event is what the export's event stream shows: no server path in it
        ctx.log("export verification failed", "error",
                verification=without_server_paths(e.result["verification"], export_id))
        kept = e.result.get("files") or []
        keep(kept)  # the types that passed stay downloadable on the failed export
        names = ", ".join(f["name"] for f in kept)
        done = f"; kept what passed: {names} (download below)" if kept else ""
        raise JobError(portable(f"export verification failed: "
                                f"{summarize(e.result['verification'])}{done} (the diff is "
                                "under Verification → details)")) from e
    except ExportError as e:
        raise JobError(portable(str(e))) from e
    if res.get("merged"):
        m = res["merged"]
        ctx.log(f"merged weights written as {m['dtype']}: {m['dtype_reason']}", "info",
                dtype=m["dtype"], dtype_reason=m["dtype_reason"])
    keep(res["files"])
    res["export_id"] = export_id
    return res

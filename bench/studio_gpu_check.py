"""The real job path on a GPU box: the studio's web process and ``python -m worker --supervise``
started as ``make run`` starts them (fresh data dir, ``WHETSTONE_ADMIN_PASSWORD``,
``WHETSTONE_SEED_DIR``), then, over HTTP with an access token: upload a dataset, create a QLoRA
run (``load_in_4bit``) and a LoRA run of the demo model stories260K, wait for both, and read
``/api/runs/{id}`` (estimate vs measured peak: the ``memory`` object), ``/api/queue`` and
``/healthz``. Prints ``RESULT {json}`` lines; the last one (``check: "summary"``) is the row.

    WHETSTONE_SEED_DIR=.seed python3 bench/studio_gpu_check.py [--steps 40] [--timeout 300]

Logs (web.log, supervisor.log) go to $OUT (default /tmp).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PASSWORD = "gpu-check-admin-password"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Api:
    def __init__(self, url: str):
        self.url, self.token = url, None

    def call(self, method: str, path: str, body=None, form=None, files=None, ok=(200, 201)):
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        data = None
        if body is not None:
            data, headers["Content-Type"] = json.dumps(body).encode(), "application/json"
        elif form is not None and files is None:
            data = urllib.parse.urlencode(form).encode()
            headers["Content-Type"] = "application/x-www-form-urlencoded"
        elif files is not None:
            b = uuid.uuid4().hex
            parts = []
            for k, v in (form or {}).items():
                parts.append(f'--{b}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'
                             .encode())
            for k, (fname, content) in files.items():
                parts.append(f'--{b}\r\nContent-Disposition: form-data; name="{k}"; '
                             f'filename="{fname}"\r\nContent-Type: application/octet-stream\r\n\r\n'
                             .encode() + content + b"\r\n")
            data = b"".join(parts) + f"--{b}--\r\n".encode()
            headers["Content-Type"] = f"multipart/form-data; boundary={b}"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        try:
            out = json.loads(raw) if raw else None
        except ValueError:
            out = raw.decode(errors="replace")[:500]
        if status not in ok:
            raise RuntimeError(f"{method} {path} -> {status}: {out}")
        return out


def result(**kw) -> dict:
    print("RESULT", json.dumps(kw), flush=True)
    return kw


def wait(pred, timeout: float, what: str, every: float = 0.5):
    end, last = time.monotonic() + timeout, None
    while time.monotonic() < end:
        try:
            last = pred()
            if last:
                return last
        except (RuntimeError, OSError) as exc:
            last = exc
        time.sleep(every)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def create_grpo(api: Api, seed: str, model_id: str, steps: int, four_bit: bool) -> str:
    """Upload 64 GSM8K prompts and create a GRPO run on them (QLoRA with ``four_bit``, else
    LoRA; 4 completions of <= 64 tokens a prompt); the run's id."""
    with open(os.path.join(seed, "grpo", "gsm8k", "train.jsonl"), "rb") as fh:
        rows = b"".join(fh.readlines()[:64])
    ds = api.call("POST", "/api/grpo/datasets", files={"file": ("gsm8k_64.jsonl", rows)})
    wait(lambda: (d := api.call("GET", f"/api/datasets/{ds['id']}"))["status"] != "validating"
         and d, 180, "prompt dataset validation")
    body = {"name": "gpu-check-grpo", "model": model_id, "dataset": ds["id"],
            "load_in_4bit": four_bit, "rewards": [{"name": "numeric_match"}], "max_steps": steps,
            "num_generations": 4, "per_device_train_batch_size": 8, "max_prompt_length": 128,
            "max_completion_length": 64, "save_steps": 1000}
    run = api.call("POST", "/api/runs/grpo", body=body)
    result(check="created", run="grpo" if four_bit else "grpo_lora", id=run["id"], state=run.get("state"),
           memory=run.get("memory"))
    return run["id"]


def gpus_summary(dash: dict) -> list[dict]:
    """Per GPU of ``/api/gpus``: the newest sample's source/name/figures and how many samples
    the last hour holds."""
    out = []
    for g in dash.get("gpus", []):
        cur = g.get("current") or {}
        out.append({"index": g.get("index"), "source": g.get("source"), "name": g.get("name"),
                    "live": g.get("live"), "util_pct": cur.get("util_pct"),
                    "mem_used_gib": cur.get("mem_used_gib"),
                    "mem_total_gib": cur.get("mem_total_gib"), "temp_c": cur.get("temp_c"),
                    "power_w": cur.get("power_w"),
                    "samples": len((g.get("history") or {}).get("ts", []))})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--dataset", default="sft/oasst1_en_100_messages.jsonl",
                    help="path under the seed dir")
    ap.add_argument("--configs", default="qlora,lora",
                    help="comma-separated: qlora, lora (SFT runs; a _pf or _pack suffix, e.g. qlora_pf, "
                    "sets padding_free or packing), grpo, grpo_lora (a QLoRA or "
                    "LoRA GRPO run on 64 GSM8K prompts of <seed>/grpo/gsm8k/train.jsonl, "
                    "numeric_match reward)")
    a = ap.parse_args(argv)
    out = os.environ.get("OUT", "/tmp")
    seed = os.path.abspath(os.environ.get("WHETSTONE_SEED_DIR") or os.path.join(REPO, ".seed"))
    data_dir = tempfile.mkdtemp(prefix="studio-gpu-")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WHETSTONE_")
           or k == "WHETSTONE_CUDA_MEMORY_HISTORY"}
    env.update({"WHETSTONE_DATA_DIR": data_dir, "WHETSTONE_HOST": "127.0.0.1",
                "WHETSTONE_PORT": str(port), "WHETSTONE_SEED_DIR": seed,
                "WHETSTONE_ADMIN_PASSWORD": PASSWORD, "PYTHONUNBUFFERED": "1",
                "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                "PYTHONPATH": os.pathsep.join([REPO, env.get("PYTHONPATH", "")])})
    logs = {n: open(os.path.join(out, f"studio_{n}.log"), "w") for n in ("web", "supervisor")}
    web = subprocess.Popen([sys.executable, "-m", "app.web.main"], cwd=REPO, env=env,
                           stdout=logs["web"], stderr=subprocess.STDOUT)
    sup = subprocess.Popen([sys.executable, "-m", "worker", "--supervise", "--poll-interval",
                            "0.5"], cwd=REPO, env=env, stdout=logs["supervisor"],
                           stderr=subprocess.STDOUT)
    api = Api(f"http://127.0.0.1:{port}")
    summary: dict = {"check": "summary", "ok": False}
    t0 = time.monotonic()
    try:
        wait(lambda: api.call("GET", "/healthz"), 120, "the web's /healthz")
        tok = api.call("POST", "/api/login/access-token",
                       form={"username": "admin", "password": PASSWORD})
        api.token = tok["access_token"]  # /healthz lists workers to an admin only
        health = wait(lambda: (h := api.call("GET", "/healthz")) and h.get("workers") and h,
                      120, "a live supervisor in /healthz")
        result(check="healthz_start", t=round(time.monotonic() - t0, 1), healthz=health)

        def demo_ready():
            models = api.call("GET", "/api/models")
            models = models.get("data", models) if isinstance(models, dict) else models
            return [m for m in models if m["name"] == "stories260K" and m["status"] == "ready"]

        model = wait(demo_ready, 180, "stories260K imported")[0]
        path = os.path.join(seed, a.dataset)
        with open(path, "rb") as fh:
            f = api.call("POST", "/v1/files", form={"purpose": "fine-tune"},
                         files={"file": (os.path.basename(path), fh.read())})
        ds = wait(lambda: (d := api.call("GET", f"/api/datasets/{f['id']}"))["status"]
                  != "validating" and d, 180, "dataset validation")
        result(check="dataset", id=f["id"], status=ds["status"], rows=ds.get("rows"),
               format=ds.get("format"))
        assert ds["status"] == "processed", ds
        runs = {}
        for name in a.configs.split(","):
            if name in ("grpo", "grpo_lora"):
                runs[name] = create_grpo(api, seed, model["id"], a.steps, name == "grpo")
                continue
            four = name.startswith("qlora")
            body = {"name": f"gpu-check-{name}", "model": model["id"], "dataset": f["id"],
                    "load_in_4bit": four, "max_steps": a.steps, "max_seq_length": 256,
                    "padding_free": name.endswith("_pf"), "packing": name.endswith("_pack"),
                    "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
                    "save_steps": 1000, "r": 16, "lora_alpha": 16}
            run = api.call("POST", "/api/runs", body=body)
            runs[name] = run["id"]
            result(check="created", run=name, id=run["id"], state=run.get("state"),
                   memory=run.get("memory"))
        seen_running: dict = {}
        queue_snaps = []

        def done():
            q = api.call("GET", "/api/queue")
            if any(g.get("running") for g in q.get("gpus", [])) and len(queue_snaps) < 3:
                queue_snaps.append(q)
            states = {}
            for name, rid in runs.items():
                r = api.call("GET", f"/api/runs/{rid}")
                states[name] = r["state"]
                if r["state"] == "running":
                    seen_running[name] = True
            return all(s in ("succeeded", "failed", "cancelled") for s in states.values()) \
                and states

        states = wait(done, a.timeout, "both runs to end", every=1.0)
        if queue_snaps:
            result(check="queue_while_running", queue=queue_snaps[0])
        ok = True
        for name, rid in runs.items():
            r = api.call("GET", f"/api/runs/{rid}")
            mem = r.get("memory") or {}
            m = r.get("metrics") or {}
            result(check="run", run=name, id=rid, state=r["state"], error=r.get("error"),
                   memory=mem, estimate=r.get("estimate"),
                   keys=sorted(r.keys()), last_metrics=m[-1] if isinstance(m, list) and m else
                   None)
            summary[name] = {"state": r["state"], "estimate_gib": mem.get("estimate_gib"),
                             "peak_gib": mem.get("peak_gib"), "peak_kind": mem.get("peak_kind"),
                             "error": mem.get("error"), "reserved_gib": mem.get("reserved_gib"),
                             "nvml_gib": mem.get("nvml_gib")}
            ok = ok and r["state"] == "succeeded" and mem.get("peak_kind") == "gpu"
        gpus = api.call("GET", "/api/gpus")
        summary["gpus"] = gpus_summary(gpus)
        if summary["gpus"]:  # "cuda:0 NVIDIA H200" -> the device name the rows compare by
            summary["device"] = (summary["gpus"][0].get("name") or "").split(" ", 1)[-1]
        result(check="gpus", gpus=summary["gpus"])
        ok = ok and bool(summary["gpus"]) and all(
            g["source"] == "nvml" and g["samples"] > 0 for g in summary["gpus"])
        q = api.call("GET", "/api/queue")
        h = api.call("GET", "/healthz")
        result(check="queue_after", queue=q)
        result(check="healthz_after", healthz=h)
        summary.update(ok=ok, states=states, seconds=round(time.monotonic() - t0, 1))
    except Exception as exc:  # noqa: BLE001 - report it as the row
        summary["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    finally:
        for p in (sup, web):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in (sup, web):
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        summary["exit_codes"] = {"supervisor": sup.returncode, "web": web.returncode}
    summary.update(bench="studio_gpu_check", date=datetime.date.today().isoformat(),
                   commit=os.environ.get("WHETSTONE_COMMIT", ""),
                   call_id=os.environ.get("CALL_ID", ""))
    result(**summary)
    with open(os.path.join(out, "results.jsonl"), "a") as fh:
        fh.write(json.dumps(summary) + "\n")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

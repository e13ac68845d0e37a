"""The custom-reward sandbox process (started by worker/rewards/sandbox.py with ``python -I``).

Protocol, one JSON object per line: the parent writes ``{"source", "entry", "style",
"memory_mb"}`` on stdin; we apply the limits, define the function and answer
``{"ok": true}`` or ``{"error": ...}``. Then each request ``{"samples": [{"prompt",
"completion", "item"}, ...], "cpu_s": n}`` gets ``{"values": [...]}`` (each value encoded as
``["num", x]``, ``["none"]`` or ``["other", type, repr]``) or ``{"error", "index",
"traceback"}``. The user's ``print`` goes to stderr; the protocol has its own file descriptor.
"""
import json
import os
import resource
import sys
import traceback


def _encode(v):
    if v is None:
        return ["none"]
    if isinstance(v, bool) or isinstance(v, (int, float)):
        return ["num", float(v)]
    try:
        r = repr(v)
    except Exception:  # noqa: BLE001
        r = "<unprintable>"
    return ["other", type(v).__name__, r[:200]]


def main():
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # user prints -> stderr
    sys.stdout = sys.stderr
    rd = sys.stdin

    def send(obj):
        proto.write(json.dumps(obj, allow_nan=True) + "\n")
        proto.flush()

    cfg = json.loads(rd.readline())
    limit = int(cfg["memory_mb"]) * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    ns = {"__name__": "custom_reward"}
    try:
        exec(compile(cfg["source"], "<custom reward>", "exec"), ns)  # noqa: S102 - the sandbox
        fn = ns.get(cfg["entry"])
        if not callable(fn):
            send({"error": f"the code defines no function named {cfg['entry']!r}"})
            return
    except BaseException as exc:  # noqa: BLE001
        send({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(-3)})
        return
    send({"ok": True})
    style = cfg.get("style", "reward")
    for line in rd:
        req = json.loads(line)
        used = resource.getrusage(resource.RUSAGE_SELF)
        cpu_now = int(used.ru_utime + used.ru_stime) + 1
        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
        soft = cpu_now + int(req.get("cpu_s", 60)) + 1
        if hard != resource.RLIM_INFINITY:
            soft = min(soft, hard)
        resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
        values = []
        for i, s in enumerate(req["samples"]):
            try:
                if style == "openai":
                    v = fn({"output_text": s["completion"]}, s["item"])
                else:
                    v = fn(s["prompt"], s["completion"], s["item"])
            except BaseException as exc:  # noqa: BLE001 - MemoryError, RecursionError, SystemExit
                send({"error": f"{type(exc).__name__}: {exc}", "index": i,
                      "traceback": traceback.format_exc(-3)})
                break
            values.append(_encode(v))
        else:
            send({"values": values})


if __name__ == "__main__":
    main()

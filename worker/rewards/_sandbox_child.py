"""The custom-reward process inside the bubblewrap jail (run by worker/rewards/sandbox.py as
``python -I -S -c <this file>``; see worker/rewards/jail.py for what the jail sees).

Protocol, one JSON object per line on stdin: ``{"source", "entry", "style", "limits":
{"memory_mb", "cpu_s", "processes", "file_mb"}}`` — the limits are the admin's, applied here
before the user's code is compiled — answered ``{"ok": true}`` or ``{"error": ...}``; then each
``{"samples": [{"prompt", "completion", "item"}, ...]}`` gets ``{"values": [...]}`` (each value
``["num", x]``, ``["none"]`` or ``["other", type, repr]``) or ``{"error", "index",
"traceback"}``. Past the CPU limit it answers ``{"error": "cpu"}`` and exits. The user's
``print`` goes to stderr; the protocol has its own file descriptor.
"""
import json
import os
import resource
import signal
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


def _tasks():
    """Tasks in this PID namespace (the jail's reaper, us and our threads): what the kernel
    counts against RLIMIT_NPROC in our user namespace."""
    n = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            n += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:  # gone meanwhile
            pass
    return n


def main():
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # user prints -> stderr
    sys.stdout = sys.stderr
    rd = sys.stdin

    def send(obj):
        proto.write(json.dumps(obj, allow_nan=True) + "\n")
        proto.flush()

    cfg = json.loads(rd.readline())
    lim = cfg["limits"]
    for res, value in ((resource.RLIMIT_AS, int(lim["memory_mb"]) << 20),
                       (resource.RLIMIT_FSIZE, int(lim["file_mb"]) << 20),
                       (resource.RLIMIT_NPROC, _tasks() + int(lim["processes"])),
                       (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(res, (value, value))

    def out_of_cpu(signum, frame):
        send({"error": "cpu"})
        os._exit(3)

    signal.signal(signal.SIGXCPU, out_of_cpu)
    cpu = int(lim["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU, then SIGKILL
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

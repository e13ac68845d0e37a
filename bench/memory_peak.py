"""Where a job's CUDA allocator peak comes from: reads the snapshots a worker writes with
``WHETSTONE_CUDA_MEMORY_HISTORY=DIR`` (worker/child.py), replays each one's allocation trace to
the moment of the peak of allocated bytes, and prints the blocks alive then, largest groups
first, each with the innermost frames of Whetstone / TRL / transformers code that allocated it.

    python3 bench/memory_peak.py DIR/*.pickle [--top 25]
"""
from __future__ import annotations

import argparse
import collections
import pickle


def frames_of(entry, keep=("whetstone", "/worker/", "/kernels/", "/app/", "trl/", "transformers/",
                           "peft/", "bitsandbytes/")) -> str:
    out = []
    for f in entry.get("frames", []):
        name = f.get("filename", "")
        if any(k in name for k in keep):
            out.append(f"{name.rsplit('/', 2)[-2]}/{name.rsplit('/', 1)[-1]}:{f.get('line')} "
                       f"{f.get('name')}")
        if len(out) == 3:
            break
    return " <- ".join(out) or "(no python frame)"


def peak_blocks(trace: list[dict]):
    """(peak bytes, {addr: entry}) at the first moment allocated bytes were highest."""
    live, cur, best, best_live = {}, 0, -1, {}
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            cur += e["size"]
            if cur > best:
                best, best_live = cur, dict(live)
        elif e["action"] in ("free_requested", "free_completed") and e["addr"] in live:
            if e["action"] == "free_requested":
                cur -= live.pop(e["addr"])["size"]
    return best, best_live


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("snapshots", nargs="+")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    for path in a.snapshots:
        with open(path, "rb") as fh:
            snap = pickle.load(fh)
        for dev, trace in enumerate(snap.get("device_traces", [])):
            if not trace:
                continue
            peak, live = peak_blocks(trace)
            print(f"== {path} device {dev}: peak {peak / 2**30:.3f} GiB allocated in "
                  f"{len(live)} blocks (trace of {len(trace)} events; blocks allocated before "
                  "the history started are not seen)")
            groups = collections.defaultdict(lambda: [0, 0])
            for e in live.values():
                g = groups[frames_of(e)]
                g[0] += e["size"]
                g[1] += 1
            for where, (size, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:a.top]:
                print(f"{size / 2**20:10.1f} MiB {n:5d} x  {where}")


if __name__ == "__main__":
    main()

"""``python -m worker`` / ``whetstone-worker``: claim and run jobs from the queue.

Flags: ``--once`` (one job, then exit), ``--poll-interval SECONDS``, ``--worker-id ID``,
``--kinds train,import_model`` (exactly these kinds, in one loop), ``--no-cpu-lane``. Without
``--kinds`` the process runs two lanes: the main one claims training (train, grpo) and a CPU lane
(worker id ``<id>-cpu``, its own thread) claims exports, model imports and dataset validation, so
those never wait behind a training run. Settings come from ``WHETSTONE_*`` (see app/settings.py).
SIGTERM/SIGINT stop the current job (training checkpoints first), put it back in the queue,
unregister the worker and exit 0.

``--supervise`` (what ``make run`` and docker/start.sh start, one per host): the process owns
the host's GPUs, admits training jobs onto them by estimated memory, several per GPU, and runs
each in its own process (worker/supervisor.py); ``--worker-id`` is then the supervisor's id
(default: the host name) and the CPU lane runs as well.

``--health`` (the worker image's HEALTHCHECK): exit 0 when the supervisor's heartbeat row
(``--worker-id``, default the host name) is fresh, else 1 with the reason (worker/health.py).
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import time

from app.settings import Settings

DOUBLE_SIGNAL_SECONDS = 2.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="whetstone-worker", description=__doc__.splitlines()[0])
    p.add_argument("--once", action="store_true", help="process one job, then exit")
    p.add_argument("--poll-interval", type=float, default=1.0,
                   help="seconds between queue polls when idle (default 1.0)")
    p.add_argument("--worker-id", default=None, help="default: <hostname>-<pid>")
    p.add_argument("--kinds", default=None,
                   help="comma-separated job kinds to claim in one loop (default: all this "
                        "worker knows, CPU kinds on the CPU lane)")
    p.add_argument("--supervise", action="store_true",
                   help="own this host's GPUs: admit jobs by memory, one process per job")
    p.add_argument("--health", action="store_true",
                   help="exit 0 when the supervisor's heartbeat (--worker-id, default the host "
                        "name) is fresh, else 1")
    p.add_argument("--no-cpu-lane", action="store_true",
                   help="no CPU lane: one loop claims every kind (CPU kinds wait behind training)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.health:
        from worker import health

        return health.main(args.worker_id)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from worker import faults
    from worker.loop import CPU_KINDS, HANDLERS, Worker

    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()] if args.kinds else None
    unknown = sorted(set(kinds or []) - set(HANDLERS))
    if unknown:
        print(f"unknown job kinds: {', '.join(unknown)} (known: {', '.join(sorted(HANDLERS))})",
              file=sys.stderr)
        return 2
    lane = kinds is None and not args.no_cpu_lane
    if lane:
        kinds = [k for k in sorted(HANDLERS) if k not in CPU_KINDS]
    if args.supervise:
        from worker.supervisor import Supervisor

        w = Supervisor(Settings(), supervisor_id=args.worker_id, kinds=kinds,
                       poll_interval=args.poll_interval)
    else:
        w = Worker(Settings(), worker_id=args.worker_id, kinds=kinds,
                   poll_interval=args.poll_interval)
    if args.supervise and (lane or kinds is None or "export" in kinds):  # it runs GGUF exports
        from worker.export.llama_build import check_in_background

        check_in_background()  # logs whether the llama.cpp build fits this CPU
    first = {"at": None}

    def on_signal(signum, _frame):  # noqa: ANN001
        # Ctrl-C in `make run` reaches the worker twice at once (the terminal signals the whole
        # process group and start.sh forwards a TERM): only a second signal that comes later than
        # DOUBLE_SIGNAL_SECONDS after the first interrupts the running step.
        now = time.monotonic()
        if first["at"] is None:
            first["at"] = now
            logging.getLogger("worker").warning("signal %s: stopping after the current step",
                                                signum)
            w.request_shutdown()
        elif now - first["at"] > DOUBLE_SIGNAL_SECONDS:
            logging.getLogger("worker").warning("signal %s again: interrupting now", signum)
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        w.start()
        if lane:
            w.start_cpu_lane()
        return w.serve(once=args.once)
    except (KeyboardInterrupt, faults.StartStopped):  # a signal while idle or starting
        return 0
    finally:
        w.stop()
        # The work is done: a duplicate signal arriving while the interpreter exits (when Python
        # has already put the default handlers back) must not turn a clean exit into "killed".
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)


if __name__ == "__main__":
    sys.exit(main())

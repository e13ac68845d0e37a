"""``python tests/worker/fault_worker.py [worker flags]``: the real worker (``python -m worker``)
with the fault-test job kinds of faultjobs.py added to its handlers."""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]

from worker import loop  # noqa: E402
from worker.__main__ import main  # noqa: E402

loop.HANDLERS.update({k: f"faultjobs:{k}" for k in ("tick", "fill", "hog", "oom", "wedge")})
sys.exit(main())

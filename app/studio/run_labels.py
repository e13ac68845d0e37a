"""How pickers name runs so that no two read alike (the playground's model picker, the compare
page's run pickers): a run is named by its name; when several listed runs share a name (or
have none), each also gets its short id and creation date (``alpaca [3f9a1c, 12-01 22:05]``).
Dates are the server's local time, as the pages' ``time`` filter shows them."""
from __future__ import annotations

import datetime as _dt
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.store.schema import Run


def short_date(ts: float) -> str:
    """``"12-01 22:05"`` (month-day hour:minute, local time) for epoch seconds ``ts``."""
    return _dt.datetime.fromtimestamp(ts).strftime("%m-%d %H:%M")


def short_id(run_id: str) -> str:
    """The first 6 characters after a run id's prefix: ``ftjob-3f9a1c…`` -> ``3f9a1c``."""
    return run_id.rsplit("-", 1)[-1][:6]


def run_tags(runs: list[Run]) -> dict[str, str]:
    """Run id -> how its entries name it: its name, plus ``[short id, date]`` when another
    listed run has the same name or it has none."""
    names = Counter(r.name for r in runs if r.name)
    return {r.id: r.name if r.name and names[r.name] == 1
            else f"{r.name or 'unnamed run'} [{short_id(r.id)}, {short_date(r.created_at)}]"
            for r in runs}

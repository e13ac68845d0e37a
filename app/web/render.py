"""Render a Jinja2 page, or only one of its named blocks for an htmx request.

htmx fragments are named blocks of the page that owns them: a full request gets the whole page;
a request carrying ``HX-Request`` gets the block named by ``HX-Target`` when the page declares
such a block, else the route's default block.
"""
from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse
from jinja2 import Environment, FileSystemLoader, select_autoescape

from app.data.report import untrained_cause
from app.web.deps import is_htmx

TEMPLATES_DIR = Path(__file__).resolve().parents[2] / "templates"


def _fmt_time(ts: float | None) -> str:
    if not ts:
        return "—"
    return _dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "—"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(n)


def _fmt_duration(sec: float | None) -> str:
    """Seconds as words ("17 min 15 s", "2 h 05 min", "40 s"), never "17:15", which reads as a
    time of day; "—" when unknown (None, or a metric without the field). static/app.js agrees."""
    if not isinstance(sec, (int, float)):
        return "—"
    sec = int(max(0, sec))
    h, rem = divmod(sec, 3600)
    m, s = divmod(rem, 60)
    if h:
        return f"{h} h {m:02d} min"
    return f"{m} min {s:02d} s" if m else f"{s} s"


def _fmt_num(x: Any, digits: int = 4) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e5):
            return f"{x:.3e}"
        return f"{x:.{digits}g}"
    return str(x)


env = Environment(loader=FileSystemLoader(str(TEMPLATES_DIR)),
                  autoescape=select_autoescape(["html", "xml"]), trim_blocks=True, lstrip_blocks=True)
env.filters["time"] = _fmt_time
env.filters["bytes"] = _fmt_bytes
env.filters["duration"] = _fmt_duration
env.filters["num"] = _fmt_num
# a report's "no trained token" reason without its advice (the page's banner gives the advice
# that fits the model: "raise max_seq_length" is wrong once it is the model's context window)
env.filters["untrained_cause"] = untrained_cause
env.filters["tojson_compact"] = lambda v: json.dumps(v, separators=(",", ":"))


def render_block(name: str, block: str, context: dict[str, Any]) -> str:
    """Render only ``block`` of template ``name``."""
    tmpl = env.get_template(name)
    ctx = tmpl.new_context(context)
    return "".join(tmpl.blocks[block](ctx))


def render(request: Request, name: str, context: dict[str, Any] | None = None, *,
           block: str | None = None, status_code: int = 200,
           headers: dict[str, str] | None = None) -> HTMLResponse:
    """The whole page, or (htmx request) one named block of it; always ``Vary: HX-Request``.

    Args:
        name: template file under ``templates/``.
        block: default block for htmx requests; ``HX-Target`` overrides it when the template
            has a block of that name. Without either, htmx requests get the whole page.
    """
    ctx = {"request": request, "path": request.url.path, **(context or {})}
    # a fragment and its page share a URL: caches (the browser's Back included) must tell them apart
    headers = {**(headers or {}), "Vary": "HX-Request"}
    if is_htmx(request):
        tmpl = env.get_template(name)
        target = request.headers.get("hx-target", "")
        chosen = target if target in tmpl.blocks else block
        if chosen:
            return HTMLResponse(render_block(name, chosen, ctx), status_code=status_code,
                                headers=headers)
    html = env.get_template(name).render(ctx)
    return HTMLResponse(html, status_code=status_code, headers=headers)

"""The compare page tells its runs apart and shows spec values one way: two runs of one name
get ``[short id, date]`` in the pickers, headings and chart legend (the playground's rule,
app.studio.run_labels); the config diff shows every value as JSON (``true``, ``["q_proj"]``),
not as a Python repr (``True``, ``['q_proj']``)."""
from __future__ import annotations

import html
import json
import re

from app.store import repo
from app.studio.run_labels import short_date, short_id
from tests.web.conftest import upload_sft
from tests.web.test_run_compare import _trained


def test_same_named_runs_are_told_apart_and_values_read_as_json(client, engine):
    ds = upload_sft(client)
    a = _trained(client, engine, ds, "w-a", 4, name="alpaca", use_rslora=True,
                 target_modules=["q_proj", "v_proj"], early_stopping_patience=3)
    b = _trained(client, engine, ds, "w-b", 4, name="alpaca")
    c = _trained(client, engine, ds, "w-c", 4, name="solo")
    tag = {r: f"alpaca [{short_id(r)}, {short_date(repo.get_run(engine, r).created_at)}]"
           for r in (a, b)}
    page = client.get("/runs/compare", params={"a": a, "b": b}).text
    picker = page[page.index('<select name="a">'):page.index("</select>")]
    options = {v: html.unescape(t) for v, t in
               re.findall(r'<option value="([^"]*)"[^>]*>([^<]*)</option>', picker)}
    assert options == {"": "choose a run", a: f"{tag[a]} · sft", b: f"{tag[b]} · sft",
                       c: f"solo · sft · {short_date(repo.get_run(engine, c).created_at)}"}
    assert len(set(options.values())) == len(options)
    assert f'<a href="/runs/{a}">{html.escape(tag[a])}</a>' in page
    data = json.loads(html.unescape(re.search(
        r'<script type="application/json" id="compare-data">(.*?)</script>', page, re.S).group(1)))
    assert (data["a"]["label"], data["b"]["label"]) == (tag[a], tag[b])

    rows = {f: (html.unescape(x), html.unescape(y)) for f, x, y in re.findall(
        r"<tr><td><code>(\w+)</code></td><td>([^<]*)</td><td>([^<]*)</td></tr>", page)}
    default_modules = repo.get_run(engine, b).spec["target_modules"]
    assert rows == {"early_stopping_patience": ("3", "—"), "use_rslora": ("true", "false"),
                    "target_modules": ('["q_proj", "v_proj"]', json.dumps(default_modules))}

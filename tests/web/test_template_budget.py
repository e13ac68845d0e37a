"""A chat template that is expensive to compile (Jinja folds ``10**(10**7)`` while compiling) is
checked in a child process under a time budget: the web keeps answering, and the submit gets a
field error naming ``chat_template`` (issue 20 #2: /healthz took 22 s)."""
from __future__ import annotations

import asyncio
import time

import httpx

from app.data import template_check
from app.data.chat_template import DEFAULT_TEMPLATES

from tests.conftest import SHARED_DATA as SHARED

SLOW = "{% if 10**(10**7) > 1 %}x{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"


async def _healthz_while(base: str, headers: dict, request) -> tuple[httpx.Response, float, int]:
    """Send ``request(client)`` and poll /healthz meanwhile: (its response, slowest healthz in s,
    healthz answers)."""
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=60) as c:
        task = asyncio.create_task(request(c))
        await asyncio.sleep(0.2)
        slowest, n = 0.0, 0
        while not task.done():
            t0 = time.perf_counter()
            r = await c.get("/healthz")
            slowest, n = max(slowest, time.perf_counter() - t0), n + 1
            assert r.status_code == 200
            await asyncio.sleep(0.1)
        return await task, slowest, n


def _dataset(engine) -> str:
    """A processed dataset owned by the admin (the shared alpaca demo file), recorded directly."""
    from app.store import repo
    from app.store.schema import Dataset, User, new_id
    from app.store.db import session_scope
    from sqlmodel import select

    with session_scope(engine) as s:
        admin = s.exec(select(User).where(User.name == "admin")).one().id
    path = SHARED / "sft" / "alpaca_en_demo.json"
    ds = Dataset(id=new_id("file"), filename=path.name, path=str(path), bytes=path.stat().st_size,
                 format="alpaca", rows=10, purpose="fine-tune", status="processed",
                 report={"format": "alpaca"}, owner=admin)
    repo.add_dataset(engine, ds)
    return ds.id


def test_slow_template_leaves_the_web_responsive_and_is_a_field_error(app, server, admin_key):
    headers = {"Authorization": f"Bearer {admin_key}"}
    ds = _dataset(app.state.engine)
    body = {"model": "stories260K", "dataset": ds, "chat_template": SLOW, "max_steps": 5}
    t0 = time.perf_counter()
    r, slowest, n = asyncio.run(_healthz_while(
        server, headers, lambda c: c.post("/api/runs", json=body)))
    took = time.perf_counter() - t0
    print(f"POST /api/runs with 10**(10**7): {r.status_code} after {took:.2f} s; "
          f"{n} /healthz answers meanwhile, slowest {slowest * 1000:.0f} ms")
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == "chat_template" and "took more than" in err["message"]
    assert n >= 3 and slowest < 1.0
    assert took < template_check.TIME_BUDGET_S + 5

    r, slowest, n = asyncio.run(_healthz_while(server, headers, lambda c: c.get(
        f"/datasets/{ds}/report", params={"chat_template": SLOW + " "})))
    print(f"dataset report with it: {r.status_code}; {n} /healthz, slowest {slowest * 1000:.0f} ms")
    assert "took more than" in r.text and n >= 3 and slowest < 1.0


def test_template_errors_while_compiling_are_field_errors(client, engine):
    ds = _dataset(engine)
    for source, says in (
            ("{% if 'a' * 'b' %}{% endif %}", "TypeError"),
            ("{{ " + "(" * 500 + "1" + ")" * 500 + " }}", "chat_template"),
            ("{% for m in messages %}{{ m.content }}{% endfor %}{{ 'x' * 10**7 }}", "characters"),
            ("{% if %}", "does not parse")):
        r = client.post("/api/runs", json={"model": "stories260K", "dataset": ds,
                                           "chat_template": source})
        assert r.status_code == 422, (source[:40], r.text)
        assert r.json()["error"]["param"] == "chat_template"
        assert says in r.json()["error"]["message"] or says == "chat_template", r.json()


def test_builtin_templates_skip_the_child_and_answers_are_cached(monkeypatch):
    calls = []
    real = template_check._check_in_child
    monkeypatch.setattr(template_check, "_check_in_child",
                        lambda s, t: calls.append(s) or real(s, t))
    for src in DEFAULT_TEMPLATES.values():
        assert template_check.template_problem(src) is None
    assert calls == []
    good = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    assert template_check.template_problem(good) is None
    assert template_check.template_problem(good) is None
    assert calls == [good]

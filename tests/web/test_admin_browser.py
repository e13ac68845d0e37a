"""An admin's pages in a real headless Chromium (Debian's package) against the served app: one
quota row's Save keeps what was typed in the other rows, and the dashboard's Workers table
stacks as cards at phone width (390 px) like the queue's and the jobs' tables."""
from __future__ import annotations

import pytest

from app.store import workers
from app.studio import accounts
from tests.web.test_queue_phone_browser import _no_horizontal_overflow, _within
from tests.web.test_web_browser import CHROMIUM, page  # noqa: F401 - the signed-in page fixture

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")]


def test_one_quota_rows_save_keeps_the_other_rows_typing(page, client):  # noqa: F811
    from playwright.sync_api import expect

    engine = client.app.state.engine
    ids = {name: client.post("/api/users", json={"name": name, "password": "member-password-1"}
                             ).json()["id"] for name in ("rosa", "bea")}

    labels = {"quota_jobs": "jobs at once for", "quota_gib": "GiB at once for",
              "quota_gpu_hours": "GPU-hours a day for", "share_weight": "fair-share weight of"}

    def cell(name: str, field: str):
        return page.get_by_label(f"{labels[field]} {name}", exact=True)

    page.goto(f"{page.base}/admin")
    cell("rosa", "quota_jobs").fill("3")
    cell("bea", "quota_gib").fill("12")
    page.locator(f"#quota-save-{ids['rosa']}").click()
    expect(page.locator("#quotas [role=status]")).to_have_text("Saved the quotas of rosa.")
    assert accounts.get_user(engine, ids["rosa"]).quota_jobs == 3
    expect(cell("bea", "quota_gib")).to_have_value("12")  # typed, not saved: still there
    assert accounts.get_user(engine, ids["bea"]).quota_gib is None
    cell("rosa", "quota_gpu_hours").fill("5")  # typed in rosa's row, then bea's Save refused
    cell("bea", "share_weight").fill("0")
    page.locator(f"#quota-save-{ids['bea']}").click()
    error = page.locator("#quotas .field-error")
    expect(error).to_have_text("Weight must be at least 0.01")
    expect(page.locator("#quotas [role=alert]")).to_have_text("Weight must be at least 0.01")
    expect(cell("bea", "quota_gib")).to_have_value("12")  # the refused row keeps its values
    expect(cell("rosa", "quota_gpu_hours")).to_have_value("5")
    expect(cell("rosa", "quota_jobs")).to_have_value("3")
    cell("bea", "share_weight").fill("2")
    page.locator(f"#quota-save-{ids['bea']}").click()
    expect(page.locator("#quotas [role=status]")).to_have_text("Saved the quotas of bea.")
    expect(error).to_have_count(0)
    bea = accounts.get_user(engine, ids["bea"])
    assert (bea.quota_gib, bea.share_weight) == (12.0, 2.0)
    expect(cell("rosa", "quota_gpu_hours")).to_have_value("5")


def test_workers_table_stacks_at_phone_width(page, client):  # noqa: F811
    engine = client.app.state.engine
    host = "gpu-box-rack-7.cluster.example.internal"
    workers.register(engine, "gpu-box-rack-7", host, 424242, "NVIDIA H200")
    workers.register(engine, "gpu-box-rack-7-gpu0", host, 424242, "cuda:0 NVIDIA H200", 139.8,
                     0, 137.8)
    workers.register(engine, "gpu-box-rack-7-cpu", host, 424242, "NVIDIA H200 (cpu lane)")
    workers.register(engine, "w1", "old-box", 9, "cpu")
    page.set_viewport_size({"width": 390, "height": 844})
    page.goto(f"{page.base}/")
    _no_horizontal_overflow(page)
    cells = "#workers tbody td"
    boxes = _within(page, cells)
    assert len(boxes) == 2 * 4  # two processes; an admin's table has Host / pid
    labels = page.locator(cells).evaluate_all(
        "els => els.map(e => getComputedStyle(e, '::before').content)")
    assert labels[:4] == ['"Process"', '"Slots and lane"', '"Host / pid"', '"Last seen"']
    # a row is a card: the slots take the card's width, not a narrow column beside the others
    widths = page.locator("#workers tbody td:nth-child(2)").evaluate_all(
        "els => els.map(e => e.getBoundingClientRect().width)")
    assert min(widths) > 300, widths

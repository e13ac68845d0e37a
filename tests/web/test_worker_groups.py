"""The dashboard's Workers card groups a process's worker rows (issue: three look-alike rows per
supervisor): one row per supervisor or plain worker, its GPU slots, CPU slot and CPU lane named
as such, each with what it runs; /healthz keeps its fields and adds ``role`` and ``group``; its
``live_workers`` counts processes, its slots and lanes counted apart."""
from __future__ import annotations

import re

from app.store import queue
from app.store import workers as workers_store


def _register(engine) -> None:
    reg = workers_store.register
    reg(engine, "box", "gpu-box", 4242, "NVIDIA H200")  # the supervisor's own row
    reg(engine, "box-gpu0", "gpu-box", 4242, "cuda:0 NVIDIA H200", 139.8, 0, 137.8)
    reg(engine, "box-gpu1", "gpu-box", 4242, "cuda:1 NVIDIA H200", 139.8, 1, 137.8)
    reg(engine, "box-cpu", "gpu-box", 4242, "NVIDIA H200 (cpu lane)")
    reg(engine, "laptop", "laptop", 77, "cpu")  # a CPU-only supervisor
    reg(engine, "laptop-main", "laptop", 77, "cpu slot (2 cores, one job at a time)")
    reg(engine, "laptop-cpu", "laptop", 77, "cpu (cpu lane)")
    reg(engine, "w1", "old-box", 9, "cpu")  # a plain worker, no lane


def test_workers_card_has_one_row_per_process_with_named_slots_and_lane(client, engine):
    _register(engine)
    job = queue.enqueue(engine, "train", {}, owner=client.get("/api/me").json()["id"])
    workers_store.touch(engine, "box-gpu1", job.id)
    html = client.get("/").text
    card = html[html.index('<div id="workers">'):]
    rows = re.findall(r'<tr data-worker="([^"]+)">', card)
    assert rows == ["box", "laptop", "w1"]

    def row(name: str) -> str:
        start = card.index(f'<tr data-worker="{name}">')
        return card[start:card.index("</tr>", start)]

    box = row("box")
    assert "supervisor with 2 GPU slots and a CPU lane" in box and "gpu-box / 4242" in box
    assert re.findall(r'<li data-role="([a-z_]+)"><strong>([^<]+)</strong>', box) == [
        ("gpu_slot", "GPU 0 slot"), ("gpu_slot", "GPU 1 slot"), ("cpu_lane", "CPU lane")]
    assert ("cuda:0 NVIDIA H200 · 137.8 of 139.8 GiB admissible: training, evaluation and "
            "playground jobs share it by memory") in box
    assert f"job {job.id}" in box and box.count(">idle<") == 2
    assert "NVIDIA H200 · exports, model imports and dataset validations" in box
    laptop = row("laptop")
    assert "supervisor with a CPU slot (no GPU) and a CPU lane" in laptop
    assert re.findall(r'<li data-role="([a-z_]+)"><strong>([^<]+)</strong>', laptop) == [
        ("cpu_slot", "CPU slot (no GPU)"), ("cpu_lane", "CPU lane")]
    assert "one training, evaluation or playground job at a time" in laptop
    w1 = row("w1")
    assert "plain worker: runs the jobs it claims itself</div>" in w1
    assert re.findall(r'<li data-role="([a-z_]+)"><strong>([^<]+)</strong>', w1) == [
        ("worker", "main loop")]

    health = client.get("/healthz").json()
    # trial: one supervisor read as 3 live workers (its own, slot and lane rows); it is one
    # process, its slots and lanes are counted apart
    assert {k: health[k] for k in ("live_workers", "gpu_slots", "cpu_slots", "cpu_lanes")} == {
        "live_workers": 3, "gpu_slots": 2, "cpu_slots": 1, "cpu_lanes": 2}
    got = {w["id"]: (w["role"], w["group"]) for w in health["workers"]}
    assert got == {"box": ("supervisor", "box"), "box-gpu0": ("gpu_slot", "box"),
                   "box-gpu1": ("gpu_slot", "box"), "box-cpu": ("cpu_lane", "box"),
                   "laptop": ("supervisor", "laptop"), "laptop-main": ("cpu_slot", "laptop"),
                   "laptop-cpu": ("cpu_lane", "laptop"), "w1": ("worker", "w1")}
    first = next(w for w in health["workers"] if w["id"] == "box-gpu1")
    assert {k: first[k] for k in ("host", "pid", "device", "current_job_id")} == {
        "host": "gpu-box", "pid": 4242, "device": "cuda:1 NVIDIA H200", "current_job_id": job.id}


def test_gpu_cards_name_their_supervisor(client, engine):
    _register(engine)
    gpus = {g["id"]: g for g in client.get("/api/gpus").json()["gpus"]}
    assert {k: (g["role"], g["supervisor"]) for k, g in gpus.items()} == {
        "box-gpu0": ("gpu_slot", "box"), "box-gpu1": ("gpu_slot", "box"),
        "laptop-main": ("cpu_slot", "laptop")}
    assert gpus["box-gpu0"]["capacity_gib"] == 137.8  # the old fields stay
    html = client.get("/gpus").text
    assert "gpu-box · GPU 1 · GPU slot of supervisor box" in html
    assert "laptop · CPU slot (no GPU) of supervisor laptop" in html


def test_workers_card_hides_hosts_pids_and_other_users_jobs_from_members(app, client, engine):
    from tests.web.conftest import signed_in

    _register(engine)
    r = client.post("/api/users", json={"name": "bea", "password": "member-password-1"})
    bea = r.json()["id"]
    admins = queue.enqueue(engine, "train", {}, owner=client.get("/api/me").json()["id"])
    hers = queue.enqueue(engine, "train", {}, owner=bea)
    workers_store.touch(engine, "box-gpu0", admins.id)
    workers_store.touch(engine, "box-gpu1", hers.id)
    card = client.get("/").text.split('<div id="workers">')[1]
    assert "gpu-box / 4242" in card and "<th>Host / pid</th>" in card
    assert f"job {admins.id}" in card and f"job {hers.id}" in card
    with signed_in(app, "bea", "member-password-1") as c:
        card = c.get("/").text.split('<div id="workers">')[1].split("</section>")[0]
        assert re.findall(r'<tr data-worker="([^"]+)">', card) == ["worker 1", "worker 2",
                                                                   "worker 3"]
        for secret in ("gpu-box", "4242", "laptop", "old-box", "Host / pid", "box-gpu",
                       f"job {admins.id}"):
            assert secret not in card, secret
        assert f"job {hers.id}" in card and card.count("another user's job") == 1
        assert "cuda:0 NVIDIA H200" in card and "supervisor with 2 GPU slots" in card
        assert "workers" not in c.get("/healthz").json()

"""Admission of a data-parallel run (issue 18) with the real queue on SQLite: a ``num_gpus=2``
job is admitted only onto two free GPU slots of one host at once (its estimate is per GPU), it
holds memory on both, and the studio refuses more GPUs than a live host has."""
from __future__ import annotations

import pytest

from app.settings import Settings
from app.store import queue, repo, workers
from app.store.admission import Slot, slot_ids
from app.store.db import make_engine
from app.store.migrate import upgrade
from app.store.schema import Dataset, Model
from app.store.specs import TrainSpec
from app.studio.errors import StudioError
from app.studio.runs import check_num_gpus

MARGIN, FAIR = 0.0, 24.0


@pytest.fixture()
def engine(tmp_path):
    url = f"sqlite:///{tmp_path / 'w.db'}"
    upgrade(url)
    eng = make_engine(url)
    repo.add_model(eng, Model(id="m", name="m", source="local", source_ref="/x", status="ready",
                              path="/x"), import_job=False)
    repo.add_dataset(eng, Dataset(id="d", filename="d.json", format="alpaca", path="/x"))
    yield eng
    eng.dispose()


def job(engine, gpus: int, gib: float):
    spec = TrainSpec(model="m", dataset="d", num_gpus=gpus, gradient_accumulation_steps=4)
    return repo.create_run(engine, spec, estimate_gib=gib)[1]


def admit(engine, slot: Slot, peers: list[Slot]):
    return queue.admit(engine, slot, 60, ["train"], MARGIN, FAIR, peers=peers)


def test_a_two_gpu_job_takes_two_slots_of_one_host_at_once(engine) -> None:
    a0, a1 = Slot("a-gpu0", "hostA", 0, 20.0, 24.0), Slot("a-gpu1", "hostA", 1, 20.0, 24.0)
    b0 = Slot("b-gpu0", "hostB", 0, 20.0, 24.0)
    small = job(engine, 1, 9.5)  # admitted with 10 GiB (0.5 GiB CUDA context)
    big = job(engine, 2, 14.5)  # 15 GiB on each of two GPUs
    assert admit(engine, a0, [a0, a1, b0]).id == small.id
    # gpu0 has 10 GiB left: the 2-GPU job needs 15 there; a1 alone, or b0 with no peer of its
    # host, cannot take it either
    assert admit(engine, a0, [a0, a1, b0]) is None
    assert admit(engine, a1, [a0, a1, b0]) is None
    assert admit(engine, b0, [a0, a1, b0]) is None
    queue.finish(engine, small.id, queue.get_job(engine, small.id).lease_owner, {})
    got = admit(engine, a1, [a0, a1, b0])
    assert got.id == big.id and slot_ids(got) == ["a-gpu1", "a-gpu0"]
    assert got.gpu_index == 1 and got.admitted_gib == 15.0  # per GPU
    # it holds 15 GiB on both slots: a 6 GiB job fits on neither, but on host B
    other = job(engine, 1, 5.5)
    assert admit(engine, a0, [a0, a1]) is None and admit(engine, a1, [a0, a1]) is None
    assert admit(engine, b0, [b0]).id == other.id


def test_the_studio_refuses_more_gpus_than_a_live_host_has(engine) -> None:
    settings = Settings(worker_stale_seconds=60)
    spec = TrainSpec(model="m", dataset="d", num_gpus=2, gradient_accumulation_steps=4)
    with pytest.raises(StudioError) as e:
        check_num_gpus(engine, settings, spec)  # no live GPU at all
    assert e.value.field == "num_gpus" and "no live worker has a GPU" in e.value.message
    for i in range(2):
        workers.register(engine, f"s-gpu{i}", "hostA", 1, f"cuda:{i} sim", 24.0, i, 22.0)
    workers.register(engine, "t-gpu0", "hostB", 1, "cuda:0 sim", 24.0, 0, 22.0)
    check_num_gpus(engine, settings, spec)  # hostA has two
    with pytest.raises(StudioError) as e:
        check_num_gpus(engine, settings, spec.model_copy(update={"num_gpus": 3}))
    assert e.value.field == "num_gpus" and "has 2" in e.value.message
    with pytest.raises(StudioError) as e:
        check_num_gpus(engine, settings, spec.model_copy(update={"gradient_accumulation_steps": 3}))
    assert e.value.field == "gradient_accumulation_steps" and "multiple of num_gpus" \
        in e.value.message


def test_the_queue_page_says_why_a_two_gpu_job_waits(engine) -> None:
    from app.store.schema import User
    from app.studio.queue_view import queue_view

    for i in range(2):
        workers.register(engine, f"a-gpu{i}", "hostA", 1, f"cuda:{i} sim", 24.0, i, 20.0)
    a0 = Slot("a-gpu0", "hostA", 0, 20.0, 24.0)
    small, big = job(engine, 1, 9.5), job(engine, 2, 14.5)
    admit(engine, a0, [a0])  # the small job takes 10 GiB of gpu0
    admin = User(id="u-admin", name="root", password_hash="x", role="admin")
    view = queue_view(engine, Settings(gpu_admit_margin=MARGIN, worker_stale_seconds=60), admin,
                      kinds=("train",))
    assert [(w.job_id, w.reason) for w in view.waiting] == [
        (big.id, "needs 2 GPUs of one host with 15.0 GiB free on each at once; 1 GPU of one "
                 "host has room now")]
    assert [len(g.running) for g in view.gpus] == [1, 0] and small.id

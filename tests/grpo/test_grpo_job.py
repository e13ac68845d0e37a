"""GRPO through the worker loop (in process, CPU): the toy task learns, errors stop the run.

The toy task: story openings as prompts to stories260K, reward 1 when the completion mentions
" Lily" (about a third of samples at the start). Mean reward must rise over 30 steps.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from app.settings import Settings
from app.store import events, queue, repo
from app.store.schema import Dataset, JobState
from app.store.specs import GrpoSpec
from worker.loop import Worker

SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
STORIES = SHARED_DATA / "models" / "stories260K"

OPENINGS = ["Once upon a time", "One day", "Once upon a time, there was", "One sunny day",
            "There was a", "Once there was"]
TOY = dict(chat_template="none", num_generations=8, per_device_train_batch_size=16,
           gradient_accumulation_steps=1, max_completion_length=16, max_prompt_length=32,
           learning_rate=2e-3, beta=0.04, r=8, lora_alpha=16, seed=1, save_steps=1000,
           rewards=[{"name": "regex_match", "label": "mentions_Lily",
                     "params": {"pattern": r"\bLily\b"}}])


@pytest.fixture(scope="module")
def studio(tmp_path_factory):
    if not (STORIES / "stories260K.bin").exists():
        pytest.skip("no shared test data")
    d = tmp_path_factory.mktemp("grpo-data")
    settings = Settings(data_dir=d, seed_dir=SHARED_DATA, heartbeat_seconds=0.5)
    w = Worker(settings, worker_id="w-grpo", poll_interval=0.05)
    w.start()
    w.serve(once=True)  # the demo model import
    assert repo.get_model(w.engine, "stories260K").status == "ready"
    toy = d / "openings.jsonl"
    toy.write_text("".join(json.dumps({"prompt": s, "id": i}) + "\n"
                           for i, s in enumerate(OPENINGS * 10)))
    ds = repo.add_dataset(w.engine, Dataset(filename="openings.jsonl", path=str(toy),
                                            format="prompt"))
    gsm = repo.add_dataset(w.engine, Dataset(
        filename="gsm8k.jsonl", path=str(SHARED_DATA / "grpo" / "gsm8k" / "test.jsonl")))
    from app.studio import accounts, first_start

    admin = first_start.ensure_admin(w.engine, "admin", "admin-password-1")
    alice = accounts.create_user(w.engine, "alice", "alice-password-1", actor=admin)
    accounts.set_custom_rewards(w.engine, admin, alice.id, True)
    mallory = accounts.create_user(w.engine, "mallory", "mallory-password-1", actor=admin)
    yield {"worker": w, "engine": w.engine, "toy": ds.id, "gsm8k": gsm.id, "admin": admin,
           "users": {"alice": alice.id, "mallory": mallory.id}}
    w.stop()


def _run(s, owner=None, **spec):
    run, job = repo.create_run(s["engine"], GrpoSpec(model="stories260K", **spec), kind="grpo",
                               owner=owner)
    assert job.kind == "grpo"
    s["worker"].serve(once=True)
    return run, queue.get_job(s["engine"], job.id)


def _events(s, job_id, type_):
    return [e.data for e in events.since(s["engine"], job_id, 0, 100000, [type_])]


def test_toy_task_reward_rises(studio):
    run, job = _run(studio, dataset=studio["toy"], max_steps=30, **TOY)
    assert job.state == JobState.SUCCEEDED, job.error
    metrics = _events(studio, job.id, "metric")
    rewards = [m["reward"] for m in metrics]
    assert len(rewards) == 30
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.25, rewards
    for m in metrics:
        for key in ("reward/mentions_Lily", "reward_std", "kl", "completion_length",
                    "frac_zero_std_groups", "loss"):
            assert key in m and math.isfinite(m[key]), (key, m)
        assert 0.0 <= m["frac_zero_std_groups"] <= 1.0
    assert max(m["kl"] for m in metrics) > 0  # the adapter moved away from the reference
    samples = _events(studio, job.id, "sample")
    assert samples and samples[-1]["rows"]
    row = samples[-1]["rows"][0]
    assert set(row) >= {"prompt", "completion", "rewards", "reward", "advantage", "group"}
    assert row["rewards"]["mentions_Lily"] in (0.0, 1.0)
    cfg = json.loads((studio["worker"].settings.data_dir / "runs" / run.id / "config.json")
                     .read_text())
    assert cfg["kind"] == "grpo" and cfg["dataset"]["prompt_column"] == "prompt"
    assert cfg["prompt_example"] == "<s>Once upon a time"
    kinds = {a.kind for a in repo.list_artifacts(studio["engine"], run.id)}
    assert kinds == {"config", "adapter", "checkpoint"}
    adapter = studio["worker"].settings.data_dir / "runs" / run.id / "adapter"
    assert (adapter / "adapter_config.json").exists()
    assert job.result["last_rewards_mean"] > job.result["first_rewards_mean"]
    studio["toy_run"] = run.id


def test_grpo_adapter_exports(studio):
    from app.studio.exports import queue_export

    if "toy_run" not in studio:
        pytest.skip("needs the toy run")
    job, _ = queue_export(studio["engine"], studio["admin"], studio["toy_run"], {"format": "adapter"})
    studio["worker"].serve(once=True)
    job = queue.get_job(studio["engine"], job.id)
    assert job.state == JobState.SUCCEEDED, job.error


def test_gsm8k_builtin_rewards_run(studio):
    run, job = _run(studio, dataset=studio["gsm8k"], max_steps=3, num_iterations=2,
                    num_generations=2,
                    per_device_train_batch_size=4, max_completion_length=8,
                    max_prompt_length=48, rewards=[
                        {"name": "numeric_match"}, {"name": "format", "weight": 0.5},
                        {"name": "length_penalty", "params": {"target_tokens": 4}}])
    assert job.state == JobState.SUCCEEDED, job.error
    logs = " ".join(e["message"] for e in _events(studio, job.id, "log"))
    assert "column 'question'" in logs and "reference column 'answer'" in logs
    metrics = _events(studio, job.id, "metric")
    assert len(metrics) == 3  # step 2 reuses step 1's generations (num_iterations=2)
    for m in metrics:
        assert {"reward", "reward/numeric_match", "reward/format", "reward/length_penalty"} <= set(m)


def test_reward_returning_none_stops_the_run(studio):
    src = ("def reward(prompt, completion, item):\n"
           "    return 1.0 if item['id'] < 0 else None\n")
    run, job = _run(studio, owner=studio["users"]["alice"], dataset=studio["toy"], max_steps=3,
                    **{**TOY, "rewards": [{"name": "custom", "label": "picky",
                                           "params": {"source": src}}]})
    assert job.state == JobState.FAILED
    assert "reward function 'picky' returned None" in job.error
    assert "offending sample #0: prompt '<s>O" in job.error and "completion '" in job.error


def test_custom_rewards_need_permission(studio):
    src = "def reward(prompt, completion, item):\n    return 1.0\n"
    run, job = _run(studio, owner=studio["users"]["mallory"], dataset=studio["toy"], max_steps=1,
                    **{**TOY, "rewards": [{"name": "custom", "params": {"source": src}}]})
    assert job.state == JobState.FAILED and "not allowed" in job.error


def test_cancel_stops_a_long_generation(studio):
    """Cancel during a rollout ends the job within seconds, before the step completes (the
    generator checks the job's stop flags while it decodes)."""
    import threading
    import time

    run, job = repo.create_run(studio["engine"], GrpoSpec(
        model="stories260K", dataset=studio["toy"], max_steps=2,
        **{**TOY, "max_completion_length": 480, "per_device_train_batch_size": 64}), kind="grpo")
    seen = {}

    def cancel_when_generating():
        t_end = time.monotonic() + 120
        while time.monotonic() < t_end:
            logs = [e.data.get("message", "") for e in events.since(
                studio["engine"], job.id, 0, 100000, ["log"])]
            if any(m.startswith("generation:") for m in logs):
                seen["t"] = time.monotonic()
                queue.cancel(studio["engine"], job.id)
                return
            time.sleep(0.05)

    th = threading.Thread(target=cancel_when_generating)
    th.start()
    studio["worker"].serve(once=True)
    th.join()
    done = time.monotonic()
    job = queue.get_job(studio["engine"], job.id)
    assert "t" in seen and job.state == JobState.CANCELLED, (job.state, job.error)
    assert done - seen["t"] < 5
    assert not [m for m in _events(studio, job.id, "metric") if m.get("step")]


def test_a_cancel_during_a_rollout_saves_the_last_completed_step(studio, monkeypatch):
    """Trial s22 F7: a cancel seen while step 3's completions are generated abandoned the step
    and ended the job with no checkpoint, so the steps since the newest one were lost although
    the cancel dialog promised a checkpoint where training stops. Now the last completed step
    (2) is saved and recorded, the attempt's segment is logged, and Resume starts at step 3."""
    import time
    from contextlib import contextmanager

    from app.studio import resume
    from worker.engine import decode

    real, rollouts, state = decode.fast_generate, [], {}

    @contextmanager
    def third_is_cancelled(lm, on_log=None, check=None):
        rollouts.append(1)
        if len(rollouts) == 3:  # step 3's rollout: the cancel arrives while it generates
            queue.cancel(studio["engine"], state["job"])
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                check()  # raises JobCancelled once the heartbeat has read the flag
                time.sleep(0.02)
            raise AssertionError("the cancel was never seen")
        with real(lm, on_log=on_log, check=check):
            yield

    monkeypatch.setattr(decode, "fast_generate", third_is_cancelled)
    run, job = repo.create_run(studio["engine"], GrpoSpec(
        model="stories260K", dataset=studio["toy"], max_steps=6, **TOY), kind="grpo")
    state["job"] = job.id
    studio["worker"].serve(once=True)
    job = queue.get_job(studio["engine"], job.id)
    assert job.state == JobState.CANCELLED, (job.state, job.error)
    assert len(rollouts) == 3
    saved = repo.list_artifacts(studio["engine"], run.id, kind="checkpoint")
    assert [a.meta.get("step") for a in saved] == [2], [a.meta for a in saved]
    folder = Path(saved[0].path)
    assert folder.name == "checkpoint-2"
    assert json.loads((folder / "trainer_state.json").read_text())["global_step"] == 2
    logs = [e["message"] for e in _events(studio, job.id, "log")]
    assert ("stopping training (cancelled) during step 3, whose rollout is abandoned; saving "
            "checkpoint-2") in logs, logs
    assert any(m.startswith("trained steps 1-2 in ") for m in logs), logs
    assert [m["step"] for m in _events(studio, job.id, "metric") if m.get("step")][-1] == 2
    # Resume continues from it: the new attempt trains steps 3-6
    monkeypatch.setattr(decode, "fast_generate", real)
    step, why = resume.resumable(studio["engine"], run, job)
    assert (step, why) == (2, None)
    _, again = repo.resume_run(studio["engine"], run.id, step, "resumed by the test")
    studio["worker"].serve(once=True)
    again = queue.get_job(studio["engine"], again.id)
    assert again.state == JobState.SUCCEEDED, again.error
    logs = [e["message"] for e in _events(studio, again.id, "log")]
    assert any(m.startswith("trained steps 3-6 in ") for m in logs), logs


def test_a_run_that_learns_nothing_says_so(studio):
    """A reward no completion can earn: every group has equal (zero) rewards, so after three steps
    the run log carries a warning that names what to change (issue 19 item 11)."""
    never = [{"name": "regex_match", "label": "never", "params": {"pattern": r"\bQQXQQ\b"}}]
    run, job = _run(studio, dataset=studio["toy"], max_steps=4, **{**TOY, "rewards": never})
    assert job.state == JobState.SUCCEEDED, job.error
    metrics = _events(studio, job.id, "metric")
    assert all(m["frac_zero_std_groups"] == 1.0 for m in metrics)
    warnings = [e for e in _events(studio, job.id, "log") if e.get("level") == "warning"
                and "GRPO is not learning" in e["message"]]
    assert len(warnings) == 1 and "num_generations" in warnings[0]["message"]

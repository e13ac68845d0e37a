"""End to end GRPO: the real web process and worker, GSM8K prompts, the OpenAI client.

Uploads 24 real GSM8K rows as a prompt dataset, creates a ``reinforcement`` fine-tuning job
with a multi grader (string_check + text_similarity), reads the run's SSE stream to the end
and checks the reward metrics, the sample table and the run page. Then a custom reward that
returns None (not allowed here: the admin setting is off) is refused with 403.
"""
from __future__ import annotations

import math

import openai
import pytest

from studio_harness import SHARED, Studio
from test_studio_e2e import read_sse

pytestmark = pytest.mark.slow


def test_grpo_on_gsm8k_through_the_openai_client(studio: Studio, tmp_path):
    rows = (SHARED / "grpo" / "gsm8k" / "train.jsonl").read_text().splitlines(keepends=True)[:24]
    with studio.client() as c:
        r = c.post("/api/grpo/datasets", files={"file": ("gsm8k_24.jsonl", "".join(rows))})
        assert r.status_code == 201, r.text
    ds = studio.processed(r.json()["id"])  # validated in the background, on the CPU lane
    assert ds["rows"] == 24 and ds["report"]["prompt_column"] == "question"
    client = openai.OpenAI(base_url=studio.url + "/v1", api_key=studio.api_key, max_retries=0,
                           timeout=60)
    grader = {"type": "multi", "calculate_output": "0.8 * exact + 0.2 * close", "graders": {
        "exact": {"type": "string_check", "operation": "like", "input": "{{sample.output_text}}",
                  "reference": "{{item.answer}}"},
        "close": {"type": "text_similarity", "evaluation_metric": "fuzzy_match",
                  "input": "{{sample.output_text}}", "reference": "{{item.answer}}"}}}
    job = client.fine_tuning.jobs.create(
        model="stories260K", training_file=ds["id"], suffix="gsm8k-grpo",
        method={"type": "reinforcement", "reinforcement": {"grader": grader, "hyperparameters": {
            "batch_size": 4, "num_generations": 2, "max_steps": 4, "max_completion_length": 12,
            "max_prompt_length": 96, "learning_rate_multiplier": 100}}})
    assert job.method.type == "reinforcement"
    with studio.client() as c:
        events = read_sse(c, f"/runs/{job.id}/events", timeout=300)
        assert events[-1]["event"] == "end" and events[-1]["data"]["state"] == "succeeded", \
            studio.tail_logs()
        metrics = [e["data"] for e in events if e["event"] == "metric"]
        assert [m["step"] for m in metrics] == [1, 2, 3, 4]
        for m in metrics:
            for key in ("reward", "reward/exact", "reward/close", "reward_std", "kl",
                        "completion_length", "frac_zero_std_groups"):
                assert key in m and math.isfinite(m[key]), (key, m)
        samples = [e["data"] for e in events if e["event"] == "sample"]
        assert samples and {"exact", "close"} == set(samples[-1]["rows"][0]["rewards"])
        page = c.get(f"/runs/{job.id}").text
        assert "Recent samples" in page and "reward-chart" in page
        run = c.get(f"/api/runs/{job.id}").json()
        assert run.get("kind", "grpo") == "grpo"
    assert client.fine_tuning.jobs.retrieve(job.id).status == "succeeded"
    with pytest.raises(openai.PermissionDeniedError):
        client.fine_tuning.jobs.create(
            model="stories260K", training_file=ds["id"],
            method={"type": "reinforcement", "reinforcement": {"grader": {
                "type": "python", "source": "def grade(sample, item):\n    return None\n"}}})

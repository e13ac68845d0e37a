"""One browser journey in headless Chromium (Debian's package), driven by Playwright.

Sign in as a member, upload a dataset (validated in the background), start a run with a held-out
split, watch the loss chart grow while it trains and the Exports form and the evaluation appear
when it ends, download the adapter, export it twice while a second run trains (exports do not wait
for training; the form keeps its choices while the list refreshes), cancel the second run;
evaluate a checkpoint, chat with the run beside its base in the playground, compare the two runs
and clone one into the form (issue 16); then a second member signs in (another browser context)
and sees none of it. Runs against the real web process and CPU worker.
"""
from __future__ import annotations

import shutil
import zipfile

import pytest

from studio_harness import SHARED, Studio, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.browser]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chart_points(page) -> int:
    return page.evaluate(
        "() => { const c = window.Chart && window.Chart.getChart('loss-chart');"
        " return c ? c.data.datasets[0].data.length : 0; }")


def sign_in(page, studio: Studio, name: str, password: str) -> None:
    """Sign in through the /login form (the page any signed-out visit redirects to)."""
    page.goto(f"{studio.url}/runs/new")
    page.wait_for_url("**/login?next=*")
    page.fill("input[name=username]", name)
    page.fill("input[name=password]", password)
    page.click("form[action='/login'] button[type=submit]")
    page.wait_for_url("**/runs/new")


def make_member(studio: Studio, name: str, password: str) -> None:
    with studio.client() as c:
        r = c.post("/api/users", json={"name": name, "password": password, "role": "member"})
        assert r.status_code in (201, 409), r.text


def start_run(page, studio: Studio, dataset_id: str, max_steps: int, name: str,
              **fields: str) -> str:
    page.goto(f"{studio.url}/runs/new")
    page.select_option("select[name=model]", label="stories260K")
    page.select_option("select[name=dataset]", value=dataset_id)
    page.fill("input[name=name]", name)
    page.fill("input[name=max_steps]", str(max_steps))
    page.fill("input[name=max_seq_length]", "128")
    page.fill("input[name=per_device_train_batch_size]", "2")
    page.fill("input[name=gradient_accumulation_steps]", "1")
    page.fill("input[name=learning_rate]", "0.003")
    for k, v in fields.items():
        page.fill(f"#run_form input[name={k}]", v)
    page.click("#run_form button[type=submit]")
    page.wait_for_url("**/runs/ftjob-*", timeout=30_000)
    return page.url.rsplit("/", 1)[-1]


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make test-setup)")
def test_browser_journey(studio: Studio, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(accept_downloads=True)
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        make_member(studio, "journey-a", "journey-a-password")
        make_member(studio, "journey-b", "journey-b-password")
        sign_in(page, studio, "journey-a", "journey-a-password")

        # 1. Upload a real dataset through the form; the report page shows its rows.
        page.goto(f"{studio.url}/datasets")
        page.set_input_files("#upload_form input[type=file]",
                             str(SHARED / "sft" / "oasst1_en_100_sharegpt.json"))
        page.click("#upload_form button[type=submit]")
        page.wait_for_url("**/datasets/file-*", timeout=60_000)
        dataset_id = page.url.rsplit("/", 1)[-1]
        # validated in the background (the page follows "validating n / N rows", then reloads)
        expect(page.locator("#report_form")).to_be_visible(timeout=120_000)
        expect(page.locator("#report")).to_contain_text("sharegpt")
        expect(page.locator("#report")).to_contain_text("95")

        # 2. Start a run; the loss chart grows while it trains.
        run_id = start_run(page, studio, dataset_id, max_steps=40, name="journey",
                           validation_split_percentage="10", eval_steps="20", save_steps="20",
                           generation_eval_samples="2")
        expect(page.locator("#m-state")).to_have_text("running", timeout=120_000)
        wait_for(lambda: chart_points(page) >= 3, 180, "3 points on the loss chart", studio)
        seen = chart_points(page)
        wait_for(lambda: chart_points(page) > seen, 120, "the chart to grow", studio)
        expect(page.locator("#m-state")).to_have_text("succeeded", timeout=300_000)
        assert chart_points(page) >= 20

        # the Exports form appears as the run finishes, without a reload (issue 19 item 7), and
        # the held-out evaluation with its base vs fine-tuned table (issue 16)
        expect(page.locator("#export_form")).to_be_visible(timeout=30_000)
        expect(page.locator("#generation-eval tbody tr")).to_have_count(2, timeout=30_000)

        # 3. A second, long run keeps the training lane busy.
        cancel_id = start_run(page, studio, dataset_id, max_steps=5000, name="to-cancel")
        expect(page.locator("#m-state")).to_have_text("running", timeout=120_000)

        # 4. Download the first run's adapter from its page.
        page.goto(f"{studio.url}/runs/{run_id}")
        link = page.locator("#artifacts a", has_text="adapter")
        with page.expect_download() as dl:
            link.first.click()
        path = tmp_path / "adapter.zip"
        dl.value.save_as(path)
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
        assert any(n.endswith("adapter_config.json") for n in names), names
        assert any(n.endswith("adapter_model.safetensors") for n in names), names

        # 5. Exports run on the CPU lane while the other run trains (item 4), and the form keeps
        # what the user picks while the list refreshes during an active export (item 1).
        page.select_option("#export_form select[name=format]", value="adapter")
        page.click("#export_form button[type=submit]")
        expect(page.locator("#exports tbody tr")).to_have_count(1)
        page.select_option("#export_form select[name=format]", value="gguf")
        page.check("#export_form input[name=quantization][value=Q8_0]")
        page.check("#export_form input[name=quantization][value=Q4_K_M]")
        page.wait_for_timeout(4500)  # two refreshes of the list while the adapter export runs
        assert page.locator("#export_form select[name=format]").input_value() == "gguf"
        assert page.locator("#export_form input[value=Q4_K_M]").is_checked()
        page.click("#export_form button[type=submit]")
        # the GGUF export's row is the newest (the adapter export above may have ended already)
        expect(page.locator("#exports tbody tr")).to_have_count(2)
        row = page.locator("#exports tbody tr").first
        expect(row).to_contain_text("gguf")
        expect(row.locator(".state")).to_have_text("succeeded", timeout=300_000)
        expect(row).to_contain_text("passed")
        expect(row.locator("a", has_text="Q8_0.gguf")).to_have_count(1)
        expect(row.locator("a", has_text="Q4_K_M.gguf")).to_have_count(1)
        with studio.client() as c:  # the long run was never paused for them
            assert c.get(f"/api/runs/{cancel_id}").json()["state"] == "running"

        # 6. The long run, cancelled from its page.
        page.goto(f"{studio.url}/runs/{cancel_id}")
        page.once("dialog", lambda d: d.accept())  # "Cancel this run?" (hx-confirm)
        page.click("#controls button")
        expect(page.locator("#m-state")).to_have_text("cancelled", timeout=60_000)
        assert not errors, errors

        # 7. Judge the first run (issue 16): evaluate its checkpoint-20 on the held-out prompts,
        # chat with it beside its base, compare it with the cancelled run, clone it.
        page.goto(f"{studio.url}/runs/{run_id}")
        page.click("#evaluate-20")
        table = page.locator("#evaluation table[id^=checkpoint-eval-table-] tbody tr")
        expect(table).to_have_count(2, timeout=180_000)
        expect(page.locator("#evaluation")).to_contain_text("checkpoint-20")
        page.click("#open-playground")
        page.wait_for_selector("#playground")
        page.fill("input[name=temperature]", "0")
        page.fill("input[name=max_tokens]", "12")
        page.fill("#pg-prompt", "Tell me a story.")
        page.click("#pg-send")
        for side in ("fine_tuned", "base"):
            answer = page.locator(f"#pg-log-{side} .pg-msg.assistant:not(.pending)")
            expect(answer).to_have_count(1, timeout=180_000)
        page.goto(f"{studio.url}/runs/{run_id}")
        page.click("#compare-run")
        page.select_option("#compare-form select[name=b]", cancel_id)
        page.click("#compare-form button[type=submit]")
        expect(page.locator("#config-diff")).to_contain_text("max_steps")
        page.goto(f"{studio.url}/runs/{run_id}")
        page.click("#clone-run")
        expect(page.locator("#run_form input[name=name]")).to_have_value("journey (copy)")
        expect(page.locator("#run_form input[name=max_steps]")).to_have_value("40")
        assert not errors, errors

        # 8. Another member, in a browser of their own, sees none of A's work.
        other = browser.new_context().new_page()
        sign_in(other, studio, "journey-b", "journey-b-password")
        other.goto(f"{studio.url}/")
        expect(other.locator("body")).not_to_contain_text(run_id)
        expect(other.locator("body")).not_to_contain_text("to-cancel")
        other.goto(f"{studio.url}/datasets")
        expect(other.locator("body")).not_to_contain_text(dataset_id)
        r = other.goto(f"{studio.url}/runs/{run_id}")
        assert r is not None and r.status == 404
        r = other.goto(f"{studio.url}/datasets/{dataset_id}")
        assert r is not None and r.status == 404
        browser.close()

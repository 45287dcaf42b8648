"""Scenario links in a real browser (headless Chromium, `streamlit run` on a free localhost port): a link opens
its run at its step on a fresh server, the address bar follows the run, and a packed scenario's link opens the
same requests."""

from __future__ import annotations

import os
import re
from urllib.parse import parse_qs, urlparse

import pytest

from conftest import CHROMIUM
from engine.scenarios import scenario_file as sf
pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Chromium is not installed")]


def wait_for_caption(page, step: int) -> None:
    page.get_by_text(re.compile(rf"^step {step} of {step} \(")).first.wait_for(timeout=120_000)


def query(page) -> dict:
    return {k: v[0] for k, v in parse_qs(urlparse(page.url).query).items()}


def test_a_link_opens_its_run_at_its_step(app_url):
    from playwright.sync_api import sync_playwright

    custom = sf.parse_scenario({"name": "two", "settings": {"num_blocks": 16, "block_size": 8, "max_model_len": 64},
                                "requests": [{"prompt": "HAMLET. ", "max_tokens": 6, "temperature": 0.0},
                                             {"arrival_step": 2, "prompt": "ROMEO. ", "max_tokens": 4, "seed": 1}]})
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1280, "height": 720})
        page.goto(f"{app_url}/?scenario=swap&step=9", wait_until="networkidle")
        wait_for_caption(page, 9)
        assert page.locator("[data-testid='stException']").count() == 0
        assert query(page) == {"scenario": "swap", "step": "9"}
        # the stage's press counter (ui.state.stage_keys) takes the keys once it is installed
        page.wait_for_function("() => document.querySelector('.paged-attention-stage')?.dataset.token",
                               timeout=60_000)
        page.keyboard.press("PageDown")  # one more step: the address bar follows
        wait_for_caption(page, 10)
        page.wait_for_function("() => location.search.includes('step=10')", timeout=30_000)

        page.goto(f"{app_url}/?scenario={sf.encode_link(custom)}&step=3", wait_until="networkidle")
        wait_for_caption(page, 3)
        assert page.locator("[data-testid='stException']").count() == 0
        assert sf.decode_link(query(page)["scenario"]) == custom and query(page)["step"] == "3"
        body = page.locator("body").inner_text()
        assert "R2" in body  # the request arriving at step 2 is in the run
        browser.close()

"""The Server page in a real browser: `streamlit run` on a free localhost port, driven by Playwright in
Debian's Chromium, watching the lab's own engine publish KV events (vLLM's format) from this process."""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import pytest

from conftest import CHROMIUM

ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]
pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Chromium is not installed")]


def cached_blocks(page) -> str | None:
    """The first rank's "cached blocks" metric as shown."""
    metric = page.locator("[data-testid='stMetric']").filter(has_text="cached blocks").first
    if not metric.count():
        return None
    return metric.locator("[data-testid='stMetricValue']").inner_text().strip()


def wait_idle(page, timeout_s: float = 90.0) -> None:
    """Wait for the script run a widget change started to finish: a widget drawn during a rerun can be
    detached under Playwright's hands (a fill then retries until its timeout on a loaded machine)."""
    page.wait_for_timeout(300)  # the rerun's start reaches the page after the key press
    page.locator("[data-testid='stStatusWidgetRunningIcon'], [data-testid='stStatusWidgetRunningManIcon']") \
        .first.wait_for(state="detached", timeout=timeout_s * 1000)


def open_more(page) -> None:
    """Unfold "Replay endpoints and /metrics" (folded by default) unless it is open."""
    if not page.get_by_role("textbox", name="Replay endpoints (optional)").is_visible():
        page.get_by_text("Replay endpoints and /metrics").click()
        page.get_by_role("textbox", name="Replay endpoints (optional)").wait_for(state="visible")


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.25)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")


def test_the_live_stream_shows_up_in_the_page(app_url, tmp_path):
    """Connect to the lab's engine publishing in vLLM's format; run a scenario step by step in a thread; the
    page's block count follows it to the engine's count and the prefix tree is drawn. A reload connects
    afresh without leaving the first tab's subscriber behind."""
    from playwright.sync_api import sync_playwright

    from engine import EngineConfig, LLMEngine
    from engine.watch.capture import read_capture
    from engine.scenarios.presets import get_scenario
    from test_ui_server import _run_workload_steps

    engine = LLMEngine(EngineConfig(semantics="v1", device="cpu", dtype="float32", block_size=16, num_blocks=64,
                                    max_model_len=256, kv_events_endpoint="tcp://127.0.0.1:0",
                                    kv_events_replay_endpoint="tcp://127.0.0.1:0"))
    pub = engine.kv_event_publisher
    tokenize = lambda text: engine.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    runner = threading.Thread(target=_run_workload_steps,
                              args=([(engine, get_scenario("shared-prefix").make(0, tokenize))], 0.1), daemon=True)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 720})
            page.goto(app_url + "/server", wait_until="networkidle")
            page.wait_for_selector("text=Not connected", timeout=90_000)

            def connect() -> None:
                # commit each value (Tab) and let its rerun finish before the next widget is touched
                page.get_by_role("textbox", name="KV events endpoints").fill(pub.endpoint)
                page.get_by_role("textbox", name="KV events endpoints").press("Tab")
                wait_idle(page)
                open_more(page)
                wait_idle(page)
                page.get_by_role("textbox", name="Replay endpoints (optional)").fill(pub.replay_endpoint)
                page.get_by_role("textbox", name="Replay endpoints (optional)").press("Tab")
                wait_idle(page)
                page.get_by_role("button", name="Connect").click()

            connect()
            page.wait_for_selector("text=connected, waiting for events", timeout=60_000)
            runner.start()
            seen = set()

            def followed() -> bool:
                seen.add(cached_blocks(page))
                return not runner.is_alive() and cached_blocks(page) == f"{expected():,}"

            def expected() -> int:
                return sum(len(b) for b in engine.block_manager.cached_blocks.values())

            wait_for(followed, 120, "the page's cached blocks to reach the engine's count")
            assert expected() > 10
            assert len(seen - {None}) >= 2  # the count grew while the engine ran
            assert page.locator(".js-plotly-plot").count() >= 3
            tree = page.locator(".js-plotly-plot").first
            assert re.search(r"rank 0: \d+ prefixes in 1 tree", tree.inner_text())
            assert tree.locator("path.point").count() >= 10  # one marker per cached block
            assert page.locator("[data-testid='stException']").count() == 0
            page.screenshot(path=str(tmp_path / "server_live.png"))
            with page.expect_download() as download:  # what was received, as a capture
                page.get_by_role("button", name="Download capture").click()
            capture = read_capture(Path(download.value.path()))
            assert len(capture.batches) == pub.published and download.value.suggested_filename.endswith(".jsonl")

            # a reload is a new session: connect again; the first session's subscriber is stopped
            page.reload(wait_until="networkidle")
            page.wait_for_selector("text=Not connected", timeout=60_000)
            connect()
            page.wait_for_selector("text=/watches 1 endpoint\\(s\\) for 1 browser session\\(s\\)/", timeout=60_000)
            wait_for(lambda: cached_blocks(page) == f"{expected():,}", 60, "the reconnected view to catch up")
            browser.close()
    finally:
        if runner.ident is not None:  # started: let it finish (else the real failure above is what to show)
            runner.join(timeout=120)
        engine.close()


@pytest.mark.peer
@pytest.mark.slow
def test_a_real_vllm_server_live_in_the_page(app_url, tmp_path):
    """The README's recipe: vLLM's OpenAI server with KV events on (``peer/vllm_server.py``), the Server page
    connected to its endpoints and /metrics; while the shared-prefix workload runs through the server's
    API, the page follows its cache to the count a second, independent subscriber in this test sees, and
    shows vLLM's own hit rate from /metrics."""
    from playwright.sync_api import sync_playwright

    from engine.watch.kv_subscriber import KVEventSubscriber
    from engine.metrics import server_hit_rate_pct
    from engine.watch.server_metrics import fetch_metrics
    from peer import vllm_server, workload

    why = vllm_server.server_available()
    if why:
        pytest.skip(f"vLLM's server cannot run here: {why}")
    with vllm_server.VllmServer(num_gpu_blocks=25, block_size=32) as server, \
            KVEventSubscriber(server.events_endpoint, server.replay_endpoint) as witness, \
            sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 720})
        page.goto(app_url + "/server", wait_until="networkidle")
        page.wait_for_selector("text=Not connected", timeout=90_000)
        page.get_by_role("textbox", name="KV events endpoints").fill(server.events_endpoint)
        open_more(page)
        page.get_by_role("textbox", name="Replay endpoints (optional)").fill(server.replay_endpoint)
        page.get_by_role("textbox", name="/metrics URL (optional)").fill(server.metrics_url)
        page.get_by_role("textbox", name="/metrics URL (optional)").press("Tab")
        page.get_by_role("button", name="Connect").click()
        page.wait_for_selector("text=connected, waiting for events", timeout=60_000)
        sender = threading.Thread(target=workload.send, args=(server, workload.shared_prefix_requests()),
                                  kwargs={"delay_s": 0.5}, daemon=True)  # ~15 s: the page refreshes each second
        sender.start()
        seen = set()

        def followed() -> bool:
            seen.add(cached_blocks(page))
            v = witness.view()
            quiet = v.last_batch_at is not None and time.time() - v.last_batch_at > 2
            return not sender.is_alive() and quiet and cached_blocks(page) == f"{v.mirror.num_blocks:,}"

        wait_for(followed, 180, "the page to follow vLLM's cache")
        assert witness.view().mirror.total_removed > 0  # it filled and evicted
        assert len(seen - {None}) >= 2  # the page moved while the server ran (a busy machine refreshes seldom)
        rate = server_hit_rate_pct(fetch_metrics(server.metrics_url))
        wait_for(lambda: page.locator("[data-testid='stMetric']").filter(has_text="prefix cache hit rate")
                 .locator("[data-testid='stMetricValue']").inner_text().strip() == f"{rate:.1f}%", 30,
                 "vLLM's hit rate from /metrics")
        assert page.locator("[data-testid='stException']").count() == 0
        page.screenshot(path=str(tmp_path / "server_vllm.png"), full_page=True)
        page.get_by_role("button", name="Stop").click()
        browser.close()

"""The Playground on stage in a real browser (headless Chromium, `streamlit run` on a free localhost port):
PageDown 30 times 50 ms apart, PageDown whatever widget has the focus, a double click and fast clicks on Step,
presses during Play (started and paused with P). Afterwards: no exception on the page, every press was one step, the step counter on the
page equals the engines' own step counts, and the contiguous baseline is in step.

The page's (invisible) press counter carries what is compared as data attributes of its element
``.paged-attention-stage`` (``ui.state.stage_keys``): sent (presses counted in the browser), handled (presses
the lab ran), ignored, recorded (steps recorded), pagedSteps and contiguousSteps (each engine's own
``step_count``)."""

from __future__ import annotations

import os
import re
import time

import pytest

from conftest import CHROMIUM

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Chromium is not installed")]

CAPTION = re.compile(r"step (\d+) of (\d+) \(")
STAGE = ".paged-attention-stage"


def stage(page) -> dict:
    """The counter's data attributes, as ints where they are counts."""
    data = page.locator(STAGE).evaluate("e => ({...e.dataset})")
    return {k: int(v) if v.isdigit() else v for k, v in data.items()}


def shown_step(page) -> tuple[int, int] | None:
    """(step shown, steps recorded) from the caption "step X of Y (...)" above the views."""
    for text in page.locator("[data-testid='stCaptionContainer']").all_inner_texts():
        m = CAPTION.search(text)
        if m:
            return int(m.group(1)), int(m.group(2))
    return None


def settle(page, sent: int, timeout: float = 120.0) -> dict:
    """Wait until the lab has handled all ``sent`` presses and the page has drawn it (the caption agrees
    with the counter's attributes) and stays so for a second; the attributes and the caption."""
    deadline, stable_since, last = time.time() + timeout, None, None
    while time.time() < deadline:
        s = stage(page)
        now = (s, shown_step(page))
        done = s.get("sent") == sent and s.get("handled") == sent and now[1] is not None \
            and now[1][1] == s.get("recorded")
        if done and now == last:
            if stable_since and time.time() - stable_since >= 1.0:
                return {**s, "shown": now[1]}
            stable_since = stable_since or time.time()
        else:
            stable_since = None
        last = now
        page.wait_for_timeout(150)
    pytest.fail(f"the page did not settle on {sent} presses: {last}")


def assert_consistent(page, s: dict) -> None:
    """No exception anywhere; the counter on the page is the engines' step count; the baseline in step."""
    body = page.locator("body").inner_text()
    assert page.locator("[data-testid='stException']").count() == 0
    assert "Traceback" not in body and "IndexError" not in body
    shown, recorded = s["shown"]
    assert shown == recorded == s["recorded"] == s["pagedSteps"] == s["contiguousSteps"], s


def test_presses_on_stage(app_url, tmp_path):
    from playwright.sync_api import sync_playwright

    measured = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1280, "height": 720})
        page.goto(app_url, wait_until="networkidle")
        # .first: while a script run replaces the page, the last run's button may still be there (stale)
        step = page.locator(".st-key-stage_step button").first
        step.wait_for(timeout=120_000)
        page.wait_for_function(f"() => document.querySelector('{STAGE}')?.dataset.token", timeout=60_000)
        assert page.locator(".st-key-stage_keys").is_hidden()  # the counter takes no room on the page
        sent = 0

        # 1. PageDown 30 times, 50 ms apart (a presenter's clicker pressed fast)
        t0 = time.time()
        for _ in range(30):
            page.keyboard.press("PageDown")
            page.wait_for_timeout(50)
        sent += 30
        s = settle(page, sent)
        measured["30 PageDown: settled after s"] = round(time.time() - t0, 1)
        assert_consistent(page, s)
        assert s["recorded"] == 30 and s["ignored"] == 0, s  # every press one step
        scroll = page.evaluate("() => document.querySelector(\"[data-testid='stMain']\")?.scrollTop ?? 0")
        assert scroll == 0  # the keys step; they do not scroll the page

        # 2. PageDown whatever widget has the focus: a number field, a toggle, the speed slider, a select
        speed = page.locator("[data-testid='stSlider'] input[type='range']").first  # the speed select_slider
        focus = {
            "number field (Seed)": page.locator("[data-testid='stSidebar'] input[aria-label='Seed']"),
            "toggle (Slot view)": page.locator("input[role='switch']").first,
            "slider (speed)": speed,
            "select (Highlight a request)": page.locator("input[aria-label='Highlight a request']"),
        }
        speed_before = speed.input_value()
        for name, widget in focus.items():
            widget.focus()
            assert page.evaluate("() => document.activeElement && document.activeElement !== document.body"), name
            page.keyboard.press("PageDown")
            sent += 1
            s = settle(page, sent)
            assert s["recorded"] == sent, (name, s)
        assert speed.input_value() == speed_before  # PageDown did not move the slider
        page.evaluate("() => document.activeElement?.blur()")

        # 3. a double click on Step, two clicks 0.25 s apart, five clicks 150 ms apart: one step each
        step.dblclick()
        sent += 2
        for pause in (250, 150, 150, 150, 150, 150):
            step.click()
            page.wait_for_timeout(pause)
        sent += 6
        s = settle(page, sent)
        assert_consistent(page, s)
        assert s["recorded"] == sent and s["ignored"] == 0, s
        measured["presses by keys and clicks"] = sent

        # 4. presses during Play: P plays (a press like the others, whatever has the focus but a text field),
        # PageDown five times while it plays, P pauses
        before = s["recorded"]
        page.keyboard.press("p")
        sent += 1
        page.wait_for_selector(".st-key-stage_play button:has-text('Pause')", timeout=60_000)
        page.wait_for_timeout(1500)
        for _ in range(5):
            page.keyboard.press("PageDown")
            page.wait_for_timeout(100)
        sent += 5
        page.wait_for_timeout(1500)
        page.keyboard.press("p")
        sent += 1
        page.wait_for_selector(".st-key-stage_play button:has-text('Play')", timeout=60_000)
        s = settle(page, sent)
        assert_consistent(page, s)
        ticks = s["recorded"] - before - 5
        assert ticks >= 1 and s["ignored"] == 0, s  # Play stepped too, and none of the five presses was lost
        measured["steps during Play"] = f"{ticks} ticks + 5 presses"

        # 5. back through the recorded steps, fast: Back clicked 3 times 100 ms apart, PageUp twice 50 ms apart
        back = page.locator(".st-key-stage_back button").first
        for _ in range(3):
            back.click()
            page.wait_for_timeout(100)
        for _ in range(2):
            page.keyboard.press("PageUp")
            page.wait_for_timeout(50)
        sent += 5
        s = settle(page, sent)
        assert page.locator("[data-testid='stException']").count() == 0
        assert s["shown"] == (s["recorded"] - 5, s["recorded"]) and s["ignored"] == 0, s  # five steps back
        measured["final"] = s
        page.screenshot(path=str(tmp_path / "stage.png"), full_page=False)
        browser.close()
    print("measured:", measured)

"""The exported HTML file of a run (viz/export.py) in a real browser, opened from disk with the network off:
it draws, the slider moves to a later step and Play advances the steps, and each time the step in words on
the page is that step's (``viz.steps.step_sentences``) and the pool title is that step's snapshot's."""

from __future__ import annotations

import os
import re

import pytest

from conftest import CHROMIUM
from engine import EMBEDDED_MODEL
from engine.model_loader import load_shared
from ui.lab import Lab
from ui.state import preset_settings
from viz import export
from viz.steps import step_sentences

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Chromium is not installed")]


def squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def expected_words(paged, contiguous) -> str:
    """The sentences annotation's text content for a step: its heading, then a bullet per sentence."""
    return squash("This step, in words" + "".join("\u2022" + s for s in step_sentences(paged, contiguous)))


def test_exported_html_steps_through_the_run_offline(tmp_path):
    from playwright.sync_api import sync_playwright

    lab = Lab.create(preset_settings("parallel-sampling"), load_shared(EMBEDDED_MODEL))
    while lab.has_work():
        lab.step()
    history = lab.run.history
    by_step = {p.step: (p, c) for p, c in history}
    path = tmp_path / "run.html"
    path.write_text(export.run_html(history, lab.run.order, title="parallel-sampling"), encoding="utf-8")

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        context = browser.new_context(viewport={"width": 1280, "height": 1000})
        context.set_offline(True)
        page = context.new_page()
        fetched, errors = [], []
        page.on("request", lambda r: None if r.url.startswith(("file:", "data:", "blob:")) else fetched.append(r.url))
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(path.as_uri())
        page.wait_for_selector(".slider-rail-rect")

        def shown() -> tuple[int, str, str]:
            """(step on the slider's label, the sentences' text, the pool's title) as drawn."""
            label = page.locator("text.slider-label").first.text_content()  # the current value: "step N"
            texts = page.evaluate("() => Array.from(document.querySelectorAll('g.annotation')).map("
                                  "g => g.textContent)")
            words = next(t for t in texts if t.startswith("This step, in words"))
            pool = next(t for t in texts if t.startswith("Paged block pool"))
            return int(re.search(r"step (\d+)", label).group(1)), squash(words), pool

        def agrees(step: int, words: str, pool: str) -> None:
            paged, contiguous = by_step[step]
            snap = paged.snapshot
            assert words == expected_words(paged, contiguous), step
            assert f"{snap.num_used_blocks}/{snap.num_blocks} blocks in use" in pool, (step, pool)

        frames = page.evaluate(f"() => document.getElementById('{export.HTML_DIV_ID}')._transitionData._frames.length")
        assert frames == len(history)
        step, words, pool = shown()
        assert step == 1
        agrees(step, words, pool)

        # drag the slider's grip three quarters of the way along its rail (plotly listens on the rail's
        # touch area, which lies under the grip)
        page.locator(".slider-rail-touch-rect").scroll_into_view_if_needed()  # under the figure
        rail = page.locator(".slider-rail-touch-rect").bounding_box()
        grip = page.locator(".slider-grip-rect").bounding_box()
        y = rail["y"] + rail["height"] / 2
        page.mouse.move(grip["x"] + grip["width"] / 2, y)
        page.mouse.down()
        page.mouse.move(rail["x"] + rail["width"] * 0.75, y, steps=8)
        page.mouse.up()
        page.wait_for_timeout(800)
        step, words, pool = shown()
        assert 15 < step < len(history), step
        agrees(step, words, pool)
        assert words != expected_words(*by_step[1])

        # back to the start with a click on the rail's left end, then Play for a few steps
        page.mouse.click(rail["x"] + 2, y)
        page.wait_for_timeout(800)
        assert shown()[0] == 1
        page.locator("g.updatemenu-button", has_text="Play").click()
        page.wait_for_timeout(3 * export.PLAY_MS + 500)
        page.locator("g.updatemenu-button", has_text="Pause").click()
        page.wait_for_timeout(600)
        step, words, pool = shown()
        assert step >= 3, step
        agrees(step, words, pool)

        assert errors == []
        assert fetched == []  # nothing but the file itself
        browser.close()

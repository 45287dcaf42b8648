"""A real browser: `streamlit run` on a free localhost port, driven by Playwright in Debian's Chromium."""

from __future__ import annotations

import os
import re

import pytest

from conftest import CHROMIUM

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Chromium is not installed")]


def test_stepping_in_a_real_browser(app_url, tmp_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1280, "height": 720})
        page.goto(app_url, wait_until="networkidle")
        step = page.get_by_role("button", name=re.compile(r"^Step"))
        step.wait_for(timeout=90_000)

        step.click()
        page.wait_for_selector("text=step 1 of 1", timeout=60_000)
        first_pool = page.locator(".js-plotly-plot").first.inner_html()
        for n in (2, 3):
            step.click()
            page.wait_for_selector(f"text=step {n} of {n}", timeout=60_000)
        assert page.locator(".js-plotly-plot").first.inner_html() != first_pool  # the pool figure changed
        assert page.locator(".st-key-block_tables .js-plotly-plot").count() == 1  # the block-table picture
        # the tables as rows are drawn only once their expander is opened (a lazy expander: no table per step)
        assert page.locator("[data-testid='stDataFrame']").count() == 0
        page.get_by_text(re.compile(r"^Block tables as rows")).click()
        page.locator("[data-testid='stDataFrame']").first.wait_for(timeout=60_000)
        step.click()  # and it stays open, redrawn with the next step
        page.wait_for_selector("text=step 4 of 4", timeout=60_000)
        assert page.locator("[data-testid='stDataFrame']").count() == 1
        assert "Traceback" not in page.locator("body").inner_text()
        assert page.locator("[data-testid='stException']").count() == 0
        page.screenshot(path=str(tmp_path / "playground.png"), full_page=False)
        browser.close()


def test_a_lesson_prediction_in_a_real_browser(app_url):
    """Commit an answer in lesson 4: the form vanishes, the engine's answer and the practice figure appear,
    the progress line counts it, and the next question's gate is still closed."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1280, "height": 720})
        page.goto(app_url + "/lesson-4", wait_until="networkidle")
        page.wait_for_selector("text=/0 of \\d+ predictions made/", timeout=90_000)
        box = page.get_by_placeholder("whole numbers in order, separated by commas").first
        box.fill("[2 2]")
        box.press("Enter")  # submits the form
        page.wait_for_selector("text=the engine agrees", timeout=60_000)
        page.wait_for_selector("text=/1 of \\d+ predictions made, 1 right/", timeout=30_000)
        assert page.get_by_placeholder("whole numbers in order, separated by commas").first.input_value() == ""
        assert page.get_by_text("Commit your answer to go on").count() == 1  # the next question waits
        assert page.locator("[data-testid='stException']").count() == 0
        browser.close()


def _all_right_code(lesson) -> str:
    """A progress code with every question of ``lesson`` answered right (the engine's own answers)."""
    import importlib

    from engine import EMBEDDED_MODEL
    from engine.model_loader import load_shared
    from lessons.common import LessonContext
    from lessons.progress import SavedProgress, encode

    ctx = LessonContext(loaded=load_shared(EMBEDDED_MODEL))
    exs = importlib.import_module(lesson.module_name).exercises(ctx)
    keys = [f"{lesson.slug}:{i}" for i in exs]
    return encode(SavedProgress({k: {"raw": exs[k.split(":")[1]].expected, "correct": True} for k in keys},
                                {k: True for k in keys}))


def test_every_lesson_runs_to_its_recap_in_a_real_browser(app_url):
    """Each of the lessons opened from a link holding a progress code with all its answers: the whole lesson
    is drawn, every reveal shown, and it ends with the recap and its save button; no exception."""
    from playwright.sync_api import sync_playwright

    from lessons import catalog

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1280, "height": 720})
        for lesson in catalog():
            n = len(lesson.exercise_ids)
            page.goto(f"{app_url}/{lesson.url_path}?progress={_all_right_code(lesson)}", wait_until="networkidle")
            page.wait_for_selector(f"text={n} of {n} predictions made, {n} right", timeout=120_000)
            page.get_by_role("heading", name="Recap").wait_for(timeout=60_000)
            # the page may still be drawing below the heading: wait for the save button's label itself
            page.get_by_text(re.compile("Save the recap")).first.wait_for(timeout=60_000)
            page.get_by_text(re.compile("Save as Markdown")).first.wait_for(timeout=30_000)
            assert page.locator("[data-testid='stException']").count() == 0, lesson.slug
            assert "Traceback" not in page.locator("body").inner_text(), lesson.slug
        browser.close()


def test_lesson_progress_survives_a_reload(app_url):
    """Commit an answer in lesson 1, reload the page: the answer is still counted (the progress code in
    the URL), and a new tab on the bare URL starts afresh."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1280, "height": 720})
        page.goto(app_url + "/lesson-1", wait_until="networkidle")
        page.wait_for_selector("text=/0 of \\d+ predictions made/", timeout=120_000)
        form = page.locator("[data-testid='stForm']").first
        radio = form.locator("[data-testid='stRadio'] label")
        if radio.count():
            radio.first.click()
        else:
            form.locator("input[type='text']").first.fill("1")
        form.get_by_role("button", name=re.compile("Commit my answer")).click()
        page.wait_for_selector("text=/1 of \\d+ predictions made/", timeout=60_000)
        page.wait_for_function("() => window.location.search.includes('progress=')", timeout=30_000)
        page.reload(wait_until="networkidle")
        page.wait_for_selector("text=/1 of \\d+ predictions made/", timeout=120_000)
        other = browser.new_page()
        other.goto(app_url + "/lesson-1", wait_until="networkidle")
        other.wait_for_selector("text=/0 of \\d+ predictions made/", timeout=120_000)
        assert page.locator("[data-testid='stException']").count() == 0
        browser.close()

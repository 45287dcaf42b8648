"""Take the README's screenshots of the running app (docs/screenshot_*.png) with Playwright + Chromium.

    .venv/bin/python -m streamlit run app.py --server.port 8611 &   then   .venv/bin/python scripts/screenshots.py
    (``scripts/screenshots.py URL lesson`` takes only the lesson's screenshot)
"""

import re
import sys

from playwright.sync_api import sync_playwright

URL = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8611"
ONLY = sys.argv[2] if len(sys.argv) > 2 else ""

# The lesson screenshot: lesson 4's tiny-block practice as a learner first meets it: the pool after A's
# prefill and the first question, not yet answered. It only scrolls: typing an answer or pressing a button
# would show the engine's answer in the README, before the learner predicts it (tests/test_lessons_trial2.py).
LESSON_SHOT = {"page": "lesson-4", "heading": "Practice with tiny blocks",
               "question": "What are the reference counts of A's blocks", "path": "docs/screenshot_lesson.png"}


def lesson_shot(page, url: str) -> None:
    """Open the lesson, scroll to the practice and take the picture; answers nothing, presses nothing."""
    page.goto(f"{url}/{LESSON_SHOT['page']}", wait_until="networkidle")
    page.get_by_text(LESSON_SHOT["question"]).first.wait_for(timeout=120_000)
    page.wait_for_timeout(2500)  # the pool's figure draws after the text
    page.get_by_role("heading", name=LESSON_SHOT["heading"]).first.evaluate("e => e.scrollIntoView({block: 'start'})")
    page.mouse.move(5, 700)  # away from the page, so no tooltip covers it
    page.wait_for_timeout(1500)
    page.screenshot(path=LESSON_SHOT["path"])


with sync_playwright() as pw:
    browser = pw.chromium.launch(executable_path="/usr/bin/chromium",
                                 args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
    page = browser.new_page(viewport={"width": 1280, "height": 720})
    if ONLY == "lesson":
        lesson_shot(page, URL)
        browser.close()
        sys.exit(0)
    page.goto(URL, wait_until="networkidle")
    step = page.get_by_role("button", name=re.compile(r"^Step"))
    step.wait_for(timeout=90_000)
    for n in range(1, 9):
        step.click()
        page.wait_for_selector(f"text=step {n} of {n}", timeout=60_000)
    page.mouse.move(5, 700)  # away from the buttons, so no tooltip covers the page
    page.wait_for_timeout(1500)
    page.screenshot(path="docs/screenshot_playground.png")
    page.mouse.wheel(0, 700)
    page.wait_for_timeout(800)
    page.screenshot(path="docs/screenshot_playground_tables.png")
    lesson_shot(page, URL)

    browser.close()

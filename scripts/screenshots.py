"""Take the README's screenshots of the running app (docs/screenshot_*.png) with Playwright + Chromium.

    .venv/bin/python -m streamlit run app.py --server.port 8611 &   then   .venv/bin/python scripts/screenshots.py
"""

import re
import sys

from playwright.sync_api import sync_playwright

URL = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8611"

with sync_playwright() as pw:
    browser = pw.chromium.launch(executable_path="/usr/bin/chromium",
                                 args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
    page = browser.new_page(viewport={"width": 1280, "height": 720})
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

    # a lesson: the tiny-block practice after two committed predictions
    page.goto(f"{URL}/lesson-4", wait_until="networkidle")
    for answer in ("2, 2", "0, 2"):
        box = page.get_by_placeholder("whole numbers in order, separated by commas").first
        box.wait_for(timeout=90_000)
        page.wait_for_timeout(1500)  # let the previous rerun settle, so the box is the live one
        box.fill(answer)
        box.press("Enter")  # submits the form
        page.wait_for_selector(f"text=You said [{answer}]", timeout=60_000)
    page.get_by_text("What are the reference counts of A's blocks").first.scroll_into_view_if_needed()
    page.mouse.wheel(0, 260)
    page.wait_for_timeout(1500)
    page.screenshot(path="docs/screenshot_lesson.png")
    browser.close()

"""The presenter view in a real browser at 1280x720 (headless Chromium, `streamlit run` on a free port), as
issue 23's second no-context trial used it:

1. beam search: N reaches the key step, on its copies; a clicker's PageDown shows the beam selection in the
   pool, the block tables and the numbers at once (the step unchanged), the pool the same way up and its title
   in the same type in both phases, and no figure has phase buttons of its own;
2. a four-line sentence (chat-workload, step 90), then Play: "step N of M" and the contiguous strip stay in
   the window at every moment sampled.
"""

from __future__ import annotations

import os
import re

import pytest

from conftest import CHROMIUM

pytestmark = [pytest.mark.slow, pytest.mark.browser,
              pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Chromium is not installed")]

W, H = 1280, 720

# The pool's plot as drawn: its title's text, bold or not, and size, the y axis's range (block 0's row on top); the numbers'
# text; the "step N of M" caption's box; the strip's bottom; whether any figure has an update menu.
STATE_JS = """() => {
  const pool = document.querySelector('.st-key-present_pool .js-plotly-plot');
  const title = pool && pool.querySelector('.gtitle');
  const cap = [...document.querySelectorAll('.st-key-present_numbers [data-testid="stCaptionContainer"]')]
    .find(e => /step \\d+ of \\d+/.test(e.innerText));
  const r = cap ? cap.getBoundingClientRect() : null;
  const strip = document.querySelector('.st-key-present_contiguous');
  return {
    title: title ? title.textContent : null,
    bold: title ? !!title.querySelector('tspan[style*="bold"]') : null,
    size: title ? getComputedStyle(title).fontSize : null,
    yrange: pool && pool._fullLayout ? pool._fullLayout.yaxis.range.map(v => Math.round(v * 10) / 10) : null,
    numbers: (document.querySelector('.st-key-present_numbers') || {}).innerText || '',
    step: cap ? cap.innerText : null, capTop: r ? r.top : null, capBottom: r ? r.bottom : null,
    stripBottom: strip ? strip.getBoundingClientRect().bottom : null,
    menus: document.querySelectorAll('.js-plotly-plot .updatemenu-container, .js-plotly-plot g.updatemenu-button').length,
  };
}"""


def settle(page, handled: int | None = None) -> dict:
    if handled is not None:
        page.wait_for_function("n => { const s = document.querySelector('.paged-attention-stage'); "
                               "return s && s.dataset.handled === String(n); }", arg=handled, timeout=120_000)
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidgetRunningIcon\"]')",
                           timeout=120_000)
    page.wait_for_selector(".st-key-present_pool .js-plotly-plot .gtitle", timeout=120_000)
    page.wait_for_timeout(1500)
    return page.evaluate(STATE_JS)


def used(text: str) -> int:
    m = re.search(r"(\d+)/64 blocks in use", text)
    assert m, text
    return int(m.group(1))


def test_beam_phases_and_step_n_of_m_on_a_1280x720_stage(app_url, tmp_path):
    from playwright.sync_api import sync_playwright

    shots = os.environ.get("PAL_PRESENTER_SHOTS_DIR") or str(tmp_path)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": W, "height": H})
        page.goto(f"{app_url}/?present=1&scenario=beam-search", wait_until="networkidle")
        page.wait_for_selector(".paged-attention-stage", state="attached", timeout=180_000)
        page.wait_for_timeout(500)
        page.keyboard.press("n")
        copies = settle(page, 1)
        page.screenshot(path=f"{shots}/stage_trial_beam_copies_{W}.png")
        page.keyboard.press("PageDown")  # a clicker's "next"
        selection = settle(page, 2)
        page.screenshot(path=f"{shots}/stage_trial_beam_selection_{W}.png")
        assert copies["step"].startswith("step 2 of") and selection["step"].startswith("step 2 of")
        assert "1/2 the copies" in copies["title"] and used(copies["title"]) == used(copies["numbers"]) == 5
        assert "2/2 after beam selection" in selection["title"]
        assert used(selection["title"]) == used(selection["numbers"]) == 2
        for phase in (copies, selection):  # the same way up, the same title type, no buttons of its own
            # plotly.js draws ``autorange: "reversed"`` as a range from the last row down to the first
            assert phase["yrange"][0] > phase["yrange"][1], phase
            assert phase["menus"] == 0, phase
        # Streamlit draws a title bold (a bold tspan); the old phase button's relayout of the text dropped it
        assert copies["bold"] and selection["bold"] and copies["size"] == selection["size"]
        page.keyboard.press("PageUp")  # back: the copies again, same step
        again = settle(page, 3)
        assert used(again["title"]) == 5 and again["step"].startswith("step 2 of")

        # a four-line sentence, then Play: "step N of M" and the strip stay in the window
        page.goto(f"{app_url}/?present=1&scenario=chat-workload&step=90", wait_until="networkidle")
        page.wait_for_selector(".paged-attention-stage", state="attached", timeout=180_000)
        long = settle(page)
        assert long["step"].startswith("step 90 of"), long
        words = page.locator(".st-key-present_words").bounding_box()
        assert words["height"] > 4 * 24, words  # the sentences take four lines or more
        assert long["capBottom"] <= H and long["stripBottom"] <= H + 1, long
        page.screenshot(path=f"{shots}/stage_trial_long_sentence_{W}.png")
        page.keyboard.press("p")
        seen = []
        for _ in range(8):
            page.wait_for_timeout(600)
            now = page.evaluate(STATE_JS)
            if now["step"] is not None:
                assert now["capBottom"] <= H and now["capTop"] >= 0, now
                assert now["stripBottom"] is None or now["stripBottom"] <= H + 1, now
                seen.append(now["step"])
        assert len(set(seen)) >= 2, seen  # Play moved on while it was sampled
        assert "measured since Play started" in page.locator(".st-key-present_numbers").inner_text()
        page.screenshot(path=f"{shots}/stage_trial_play_{W}.png")
        browser.close()

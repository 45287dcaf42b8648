"""The presenter view in a real browser (headless Chromium, `streamlit run` on a free port), as a speaker
opens it: a link with ``?present=1&scenario=<preset>``, then N (the clicker's "next event" key) to reach
the preset's key moment (its first copy-on-write, prefix hit, preemption or swap). At 1280x720 and at
1920x1080 every key element (the step's sentences, the pool, the block-table picture, the contiguous strip
and the numbers) lies inside the window, the sidebar is hidden, no exception is on the page, and the
figures' type is at least the projector's minimum.

With ``PAL_SCREENSHOTS_DIR`` set, the README's pair is written there (the README's come from this test:
``PAL_SCREENSHOTS_DIR=docs pytest tests/test_browser_presenter.py``)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from conftest import CHROMIUM

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Chromium is not installed")]

PRESETS = ["parallel-sampling", "beam-search", "shared-prefix", "batch", "swap"]
SIZES = [(1280, 720), (1920, 1080)]
KEY_ELEMENTS = ["present_words", "present_pool", "present_tables", "present_contiguous", "present_numbers"]
README_SHOTS = {"shared-prefix": "screenshot_presenter_{w}.png"}  # the README's pair


# Every visible text on the page's main area: an element with its own non-blank text (HTML or SVG), its computed
# font size; returns how many were measured and those under the promise's 18 px floor ([size, text]).
SMALL_TEXT_JS = """() => {
  const main = document.querySelector('[data-testid="stMain"]') || document.body;
  let count = 0; const under = [];
  for (const el of main.querySelectorAll('*')) {
    const own = [...el.childNodes].some(n => n.nodeType === 3 && n.textContent.trim());
    if (!own) continue;
    const r = el.getBoundingClientRect(), cs = getComputedStyle(el);
    if (r.width === 0 || r.height === 0 || cs.visibility === 'hidden' || cs.display === 'none') continue;
    if (el.closest('.st-key-stage_keys, [data-testid="stTooltipContent"], .hoverlayer')) continue;
    count += 1;
    const px = parseFloat(cs.fontSize);
    if (px < 30) under.push([px, el.textContent.trim().slice(0, 40)]);
  }
  under.sort((a, b) => a[0] - b[0]);
  return {count, under};
}"""


# Labels cut short: a text of a widget label, a button, a caption or the stage's words and numbers whose box (or
# one of its 4 nearest ancestors) clips it (overflow not visible, or an ellipsis) while its content is wider.
TRUNCATED_JS = """() => {
  const main = document.querySelector('[data-testid="stMain"]') || document.body;
  const scope = '[data-testid="stWidgetLabel"], [data-testid="stButton"], [data-testid="stCaptionContainer"], '
              + '.st-key-present_words, .st-key-present_numbers';
  const cut = [];
  let count = 0;
  for (const el of main.querySelectorAll('*')) {
    if (el instanceof SVGElement || !el.closest(scope)) continue;
    if (![...el.childNodes].some(n => n.nodeType === 3 && n.textContent.trim())) continue;
    const r = el.getBoundingClientRect();
    if (r.width === 0 || r.height === 0) continue;
    count += 1;
    let node = el;
    for (let k = 0; k < 5 && node && node !== main; k++, node = node.parentElement) {
      const cs = getComputedStyle(node);
      const clips = cs.overflowX !== 'visible' || cs.textOverflow === 'ellipsis';
      if (clips && node.scrollWidth > node.clientWidth + 1) {
        cut.push([el.textContent.trim().slice(0, 40), node.scrollWidth, node.clientWidth]); break;
      }
    }
  }
  return {count, cut};
}"""


def key_step_caption(page) -> str:
    for text in page.locator(".st-key-present_numbers [data-testid='stCaptionContainer']").all_inner_texts():
        if re.search(r"step \d+ of \d+", text):
            return text
    return ""


def open_key_step(page, url: str) -> str:
    """Open the preset in the presenter view, press N once; the caption of the step reached."""
    page.goto(url, wait_until="networkidle")
    page.wait_for_selector(".paged-attention-stage", state="attached", timeout=180_000)
    page.wait_for_timeout(500)
    page.keyboard.press("n")
    page.wait_for_function("() => { const s = document.querySelector('.paged-attention-stage'); "
                           "return s && s.dataset.handled === '1'; }", timeout=120_000)
    page.wait_for_selector(".st-key-present_tables .js-plotly-plot", timeout=120_000)
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidgetRunningIcon\"]')",
                           timeout=120_000)
    page.wait_for_timeout(1500)  # the figures finish drawing
    return key_step_caption(page)


@pytest.mark.parametrize("width,height", SIZES)
def test_each_preset_key_step_fits_the_screen(app_url, tmp_path, width, height):
    from playwright.sync_api import sync_playwright

    from viz.presenter import presenter_sizes

    promised = {720: 18, 1080: 27}[height]
    assert presenter_sizes(height)["font"] == promised
    readme_dir = Path(os.environ.get("PAL_SCREENSHOTS_DIR") or tmp_path)
    shots_dir = Path(os.environ.get("PAL_PRESENTER_SHOTS_DIR") or tmp_path)  # every preset's, to look at
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        page = browser.new_page(viewport={"width": width, "height": height})
        for preset in PRESETS:
            caption = open_key_step(page, f"{app_url}/?present=1&scenario={preset}")
            assert re.search(r"step \d+ of \d+", caption), (preset, caption)
            assert page.locator("[data-testid='stException']").count() == 0, preset
            assert not page.locator("section[data-testid='stSidebar']").is_visible(), preset
            for key in KEY_ELEMENTS:
                box = page.locator(f".st-key-{key}").first.bounding_box()
                assert box is not None, (preset, key)
                assert box["y"] >= 0 and box["y"] + box["height"] <= height + 1, (preset, key, box, height)
                assert box["x"] >= 0 and box["x"] + box["width"] <= width + 1, (preset, key, box, width)
            # the README's promise: every text on stage at least 18 px at 720 lines, 27 at 1080 (the figures'
            # labels, ticks, legends and titles, the sentences, the numbers, the buttons and captions)
            small = page.evaluate(SMALL_TEXT_JS)
            assert small["count"] > 50, (preset, small)
            assert not small["under"] or min(u[0] for u in small["under"]) >= promised, (preset, promised, small["under"][:8])
            # nothing cut short: every label, button, caption and sentence shows all its text (at 1280 px the
            # "Presenter view" toggle's label was cut to "Presenter ...")
            cut = page.evaluate(TRUNCATED_JS)
            assert cut["count"] > 5 and not cut["cut"], (preset, width, cut)
            assert page.get_by_text("Presenter view", exact=True).is_visible(), preset
            # a copy's "1->2" is one arrow character: no line breaks inside it
            assert "->" not in page.locator(".st-key-present_words").inner_text(), preset
            if preset in README_SHOTS:
                page.screenshot(path=str(readme_dir / README_SHOTS[preset].format(w=width)))
            page.screenshot(path=str(shots_dir / f"presenter_{preset}_{width}.png"))
        browser.close()

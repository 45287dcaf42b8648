"""Presses on stage survive what used to stop the page (issue 23, item 16), in a real browser (headless Chromium,
`streamlit run` on a free localhost port).

1. Streamlit's forward-message cache. The browser keeps large element messages and names them in each rerun
   request; the server sends a reference for those it would send again; the browser drops a message when the
   end of a run leaves it more than ``global.maxCachedMessageAge`` runs unused. Presses faster than the page
   redraws (PageDown, PageDown, PageUp: a step shown again) let the end of the previous run drop a message
   between the request that named it and the reference: "Cached ForwardMsg MISS", a fatal error; the page
   stopped and every later press was dropped (1 run in 5 under load, with the default age 2). Here the server
   runs with an age of 0, so that any overlap of a request with the end of a run hits it: the burst failed at
   once before ``.streamlit/config.toml`` turned the cache off (``global.minCachedMessageSize``).
2. A report lost on its way (a rerun request dropped while the page reconnects, or aimed at a fragment a full
   run has just replaced): the browser's counter sends its total again until the server's render says every
   press was handled (``ui.state.RETRY_MS``). Here the test drops the report of one press on the websocket."""

from __future__ import annotations

import os
import time

import pytest

from conftest import CHROMIUM, serve_app
from test_browser_stage import STAGE, settle, stage

pytestmark = [pytest.mark.browser, pytest.mark.slow,
              pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Chromium is not installed")]

FATAL = ("Cached ForwardMsg MISS", "fatal error", "Cannot send rerun backMessage")


@pytest.fixture(scope="module")
def short_cache_url():
    """The app with the browser's message cache expiring at the end of every run (age 0)."""
    yield from serve_app({"STREAMLIT_GLOBAL_MAX_CACHED_MESSAGE_AGE": "0"})


def open_stage(pw, url: str, route=None):
    """A fresh browser session on the Playground, its press counter ready; the console's fatal errors are
    collected in ``page.fatal``. ``route``: a websocket handler installed before the page opens."""
    browser = pw.chromium.launch(executable_path=CHROMIUM, args=[
        "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"])
    page = browser.new_page(viewport={"width": 1280, "height": 720})
    page.fatal = []
    page.on("console", lambda m: page.fatal.append(m.text) if any(f in m.text for f in FATAL) else None)
    if route is not None:
        page.route_web_socket("**/_stcore/stream", route)
    page.goto(url, wait_until="networkidle")
    page.locator(".st-key-stage_step button").first.wait_for(timeout=120_000)
    page.wait_for_function(f"() => document.querySelector('{STAGE}')?.dataset.token", timeout=60_000)
    return browser, page


def wait_handled(page, sent: int, timeout: float) -> dict:
    """Wait until the lab has handled ``sent`` presses; fail at once on a fatal error in the page."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert not page.fatal, page.fatal[:2]
        s = stage(page)
        if s.get("handled") == sent:
            return s
        page.wait_for_timeout(250)
    pytest.fail(f"{sent} presses sent, the lab handled {stage(page).get('handled')} within {timeout:.0f} s")


def test_clicker_burst_in_the_prompt_survives_cache_expiry(short_cache_url):
    """60 presses 30 ms apart, PageDown, PageDown, PageUp (every PageUp shows a step the page drew two presses
    before), the focus in the sidebar's prompt text area: no fatal error, every press one step or one step
    back, the text area untouched and still focused."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser, page = open_stage(pw, short_cache_url)
        prompt = page.locator("[data-testid='stSidebar'] textarea").first
        before = prompt.input_value()
        prompt.focus()
        for i in range(60):
            page.keyboard.press("PageUp" if i % 3 == 2 else "PageDown")
            page.wait_for_timeout(30)
        wait_handled(page, 60, timeout=180)
        s = settle(page, 60)
        assert not page.fatal, page.fatal[:2]
        # 20 x (run a step, run a step, back one): 21 steps recorded, step 20 on screen
        assert s["shown"] == (20, 21), s
        assert s["recorded"] == s["pagedSteps"] == s["contiguousSteps"] == 21 and s["ignored"] == 0, s
        errors = page.locator("[data-testid='stException']").all_inner_texts()
        assert not errors, errors[0][:2000]
        assert prompt.input_value() == before
        assert page.evaluate("() => document.activeElement?.tagName") == "TEXTAREA"
        browser.close()


def test_a_lost_report_is_sent_again(short_cache_url):
    """The websocket drops the first report of the third press (its rerun request never reaches the server),
    and nothing else happens on the page: the counter sends the total again and the press runs."""
    from playwright.sync_api import sync_playwright

    dropped = []
    armed = {"n": None}

    def route(ws):
        server = ws.connect_to_server()

        def up(message):
            lost = armed["n"] is not None and isinstance(message, bytes) \
                and f'"n":{armed["n"]},'.encode() in message and not dropped
            if lost:
                dropped.append(len(message))
            else:
                server.send(message)
        ws.on_message(up)

    with sync_playwright() as pw:
        browser, page = open_stage(pw, short_cache_url, route)
        for _ in range(2):
            page.keyboard.press("PageDown")
            page.wait_for_timeout(100)
        settle(page, 2)
        armed["n"] = 3
        page.keyboard.press("PageDown")
        s = wait_handled(page, 3, timeout=60)
        assert len(dropped) == 1  # the press's own report was lost
        assert s.get("resent", 0) >= 1, s
        s = settle(page, 3)
        assert s["shown"] == (3, 3) and s["recorded"] == s["pagedSteps"] == s["contiguousSteps"] == 3, s
        assert not page.fatal
        browser.close()


def _counter_page(pw):
    """A blank page with the stage counter's module loaded and ``window.mount(data)`` mounting it as
    Streamlit does (a fake component: its reports collected in ``window.sent``); returns (browser, page)."""
    from ui.state import _stage_js

    browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
    page = browser.new_page()
    page.set_content("<html><body><div id='parent'></div><textarea></textarea></body></html>")
    page.evaluate("""async (src) => {
        const mod = await import(URL.createObjectURL(new Blob([src], { type: "text/javascript" })));
        window.sent = [];
        window.mount = (data) => { window.cleanup = mod.default({ data, parentElement: document.getElementById("parent"),
            setStateValue: (key, value) => window.sent.push([key, value]) }); };
    }""", _stage_js())
    return browser, page


def _reports(page) -> list[int]:
    return page.evaluate("() => window.sent.filter(([k]) => k === 'presses').map(([, v]) => v.n)")


def test_a_remount_keeps_the_presses_not_yet_handled():
    """Streamlit unmounts the counter and mounts it again within one redraw when a run is cut short by the
    next press (seen under load: 3 presses of a 60-press burst lost, the new counter starting from what the
    server had handled). The presses counted before the unmount, and those between it and the next mount, are
    kept and reported by the new mount; with no mount after it, the counter lets go of the keys."""
    from playwright.sync_api import sync_playwright

    from ui.state import TEARDOWN_MS

    with sync_playwright() as pw:
        browser, page = _counter_page(pw)
        page.evaluate("() => window.mount({ token: 'lab', handled: 0 })")
        for _ in range(3):
            page.keyboard.press("PageDown")
        assert _reports(page) == [1, 2, 3]
        page.evaluate("() => { window.cleanup(); }")
        page.keyboard.press("PageUp")  # between the unmount and the mount: counted, not yet sent
        assert _reports(page) == [1, 2, 3]
        page.evaluate("() => window.mount({ token: 'lab', handled: 1 })")  # the server had run one press
        assert _reports(page)[-1] == 4, _reports(page)
        assert page.evaluate("() => window.__pagedAttentionStage.log") == "FFFB"
        page.evaluate("() => window.mount({ token: 'lab', handled: 4 })")  # a redraw, all handled: no report
        assert _reports(page) == [1, 2, 3, 4]
        # left for good: after TEARDOWN_MS the keys are the page's again
        page.evaluate("() => { window.cleanup(); }")
        page.wait_for_timeout(TEARDOWN_MS + 300)
        assert page.evaluate("() => window.__pagedAttentionStage === undefined")
        page.keyboard.press("PageDown")
        assert _reports(page) == [1, 2, 3, 4]
        browser.close()

"""The class server (``infra/class_limits.py``, ``ui/class_server.py``): sizes refused before any allocation, on
every server and below a class server's caps and per-session budget; the model locked to the embedded model
and an allow-list; one cached copy of the weights per real folder; the recorded history bounded with a note on
the page; idle sessions' labs released; nothing fetched from outside the server (a real browser)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
from streamlit.testing.v1 import AppTest

from engine import EMBEDDED_MODEL, EngineConfig, SamplingParams
from infra import class_limits as limits
from engine import llm_engine, model_loader
from engine.model_loader import ModelLoadError, load_shared

ROOT = Path(__file__).resolve().parent.parent
APP = str(ROOT / "app.py")
MIB = 2**20


@pytest.fixture
def class_mode(monkeypatch):
    """A class server's environment, restored afterwards."""
    monkeypatch.setenv(limits.CLASS_SERVER_ENV, "1")
    for name in (limits.ALLOWED_MODELS_ENV, limits.SESSION_MEMORY_ENV, limits.HISTORY_STEPS_ENV,
                 limits.IDLE_MINUTES_ENV, limits.SEATS_ENV):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def no_allocation(monkeypatch):
    """Fail the test if a KV pool, a swap pool or an allocator's block lists are ever built."""
    def boom(*args, **kwargs):
        raise AssertionError("allocated: the size was not refused before allocation")
    monkeypatch.setattr(llm_engine, "KVCache", boom)
    monkeypatch.setattr(llm_engine, "BlockManager", boom)
    monkeypatch.setattr(llm_engine, "ContiguousAllocator", boom)


@pytest.fixture(scope="module")
def loaded():
    return load_shared(EMBEDDED_MODEL)


# ------------------------------------------------------------------------------ sizes, on any server
def test_a_huge_pool_is_refused_before_allocation_on_any_server(loaded, no_allocation, monkeypatch):
    monkeypatch.delenv(limits.CLASS_SERVER_ENV, raising=False)
    with pytest.raises(ValueError, match=r"pool of 300,000 blocks"):
        llm_engine.LLMEngine(EngineConfig(num_blocks=300_000, max_model_len=256), loaded)


def test_a_huge_swap_pool_is_refused_before_allocation_on_any_server(loaded, no_allocation, monkeypatch):
    monkeypatch.delenv(limits.CLASS_SERVER_ENV, raising=False)
    with pytest.raises(ValueError, match=r"swap_space_blocks 1000000000 needs .* GiB"):
        llm_engine.LLMEngine(EngineConfig(num_blocks=64, max_model_len=256, preemption_mode="swap",
                                          swap_space_blocks=10**9), loaded)


def test_outside_class_mode_nothing_is_capped(monkeypatch):
    monkeypatch.delenv(limits.CLASS_SERVER_ENV, raising=False)
    assert limits.class_limits() is None and limits.history_limit() is None
    EngineConfig(num_blocks=10_000, block_size=512, model="some-org/some-model")  # refused later, if at all


# ------------------------------------------------------------------------------ class server caps
@pytest.mark.parametrize("field, value", [
    ("num_blocks", 300_000), ("block_size", 1024), ("max_model_len", 100_000),
    ("swap_space_blocks", 10**9), ("kv_budget_bytes", 2**40), ("max_num_batched_tokens", 10**7),
])
def test_class_caps_refuse_each_field_by_name_before_allocation(class_mode, no_allocation, loaded, field, value):
    """The app checks the run's spec where it builds the lab's engines (``class_limits.check_spec``)."""
    from ui.lab import Lab
    from ui.state import preset_settings

    kwargs = {"kv_budget_mb": value / MIB} if field == "kv_budget_bytes" else {field: value}
    if field == "max_num_batched_tokens":
        kwargs["semantics"] = "v1"  # V1's token budget
    with pytest.raises(ValueError, match=rf"^{field} {value:,} (\(\S+ MiB\) )?is above this class server's limit of [\d,]+"):
        Lab.create(preset_settings("batch", **kwargs), loaded)


def test_class_caps_admit_every_preset(class_mode, loaded):
    """The caps refuse nothing the app itself runs: every preset's lab builds on a class server."""
    from engine.scenarios.presets import SCENARIOS
    from ui.lab import Lab
    from ui.state import preset_settings

    for name in SCENARIOS:
        Lab.create(preset_settings(name), loaded)


def test_the_session_budget_refuses_a_lab_naming_its_parts(class_mode, loaded):
    from ui.class_server import check_sizes, session_bytes
    from ui.state import preset_settings

    settings = dataclasses.replace(preset_settings("batch"), num_blocks=4096, preemption_mode="swap",
                                   swap_space_blocks=4096)
    parts = session_bytes(settings, loaded)
    per_block = 2 * 4 * 2 * 32 * 4 * 16  # K and V x layers x KV heads x head_dim x float32 x block_size
    assert parts == {"paged pool": 4096 * per_block, "swap pool": 4096 * per_block,
                     "contiguous region": 4096 * per_block}
    class_mode.setenv(limits.SESSION_MEMORY_ENV, "64")  # 64 MiB a session; these settings need 384 MiB
    with pytest.raises(ValueError, match=r"need 384\.0 MiB of KV memory \(paged pool 128\.0 MiB, swap pool "
                                         r"128\.0 MiB, contiguous region 128\.0 MiB\) but one session .* "
                                         r"64\.0 MiB"):
        check_sizes(settings, loaded)
    check_sizes(preset_settings("batch"), loaded)  # the default lab fits


def test_the_session_budget_is_the_free_memory_over_the_seats(class_mode):
    class_mode.setenv(limits.SEATS_ENV, "4")
    got = limits.class_limits()
    assert limits.session_budget_bytes(got, available=1000 * MIB) == 250 * MIB
    class_mode.setenv(limits.SESSION_MEMORY_ENV, "100")
    assert limits.session_budget_bytes(limits.class_limits(), available=1000 * MIB) == 100 * MIB
    with pytest.raises(ValueError, match=r"these settings need 300\.0 MiB"):
        limits.check_session_bytes({"paged pool": 300 * MIB}, limits.class_limits(), available=10**12)


def test_session_bytes_are_what_the_engines_allocate(class_mode, loaded):
    """The bytes checked are the bytes the lab's engines then hold (their K/V tensors)."""
    from ui.class_server import session_bytes
    from ui.lab import Lab
    from ui.state import preset_settings

    settings = dataclasses.replace(preset_settings("batch"), preemption_mode="swap", swap_space_blocks=20)
    lab = Lab.create(settings, loaded)

    def held(engine) -> int:
        kv = engine.kv_cache
        tensors = kv.key_cache + kv.value_cache + getattr(kv, "swap_key", []) + getattr(kv, "swap_value", [])
        return sum(t.numel() * t.element_size() for t in tensors)

    assert sum(session_bytes(settings, loaded).values()) == held(lab.run.paged) + held(lab.run.contiguous)


def test_the_request_cap(class_mode, loaded):
    from engine.scenarios.run_spec import RunSpec
    from ui.lab import Lab

    lab = Lab.create(RunSpec(model=EMBEDDED_MODEL, preset="custom", num_blocks=64, max_model_len=256), loaded)
    cap = limits.class_limits().max_requests
    for _ in range(cap):
        lab.add_request("ROMEO. ", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=rf"at most {cap} requests per run \({cap} added already\)"):
        lab.add_request("ROMEO. ", SamplingParams(max_tokens=2))


def test_a_malformed_limit_is_refused_by_name(class_mode):
    class_mode.setenv(limits.IDLE_MINUTES_ENV, "soon")
    with pytest.raises(ValueError, match=r"PAL_IDLE_MINUTES='soon' must be a number"):
        limits.class_limits()


# ------------------------------------------------------------------------------ the model
def test_the_class_server_refuses_a_hub_id_before_fetching(class_mode, monkeypatch):
    monkeypatch.setattr(model_loader, "_load_cached", lambda *a: pytest.fail("a load was attempted"))
    monkeypatch.setattr(model_loader, "_hub_reachable", lambda *a, **k: pytest.fail("the hub was asked"))
    from ui.lab import Lab
    from ui.state import preset_settings

    with pytest.raises(ValueError, match=r"model 'gpt2': this class server loads no model from the hub"):
        Lab.create(preset_settings("batch", model="gpt2"))
    with pytest.raises(ValueError, match=r"loads no model from the hub"):
        Lab.create(preset_settings("batch", model="Qwen/Qwen3-0.6B"))
    with pytest.raises(ValueError, match=r"loads no model from the hub"):
        from infra.runs import shared_model
        shared_model("Qwen/Qwen3-0.6B")


def test_the_allow_list_admits_a_listed_folder_only(class_mode, tmp_path, loaded):
    listed, unlisted = tmp_path / "listed", tmp_path / "unlisted"
    shutil.copytree(EMBEDDED_MODEL, listed)
    shutil.copytree(EMBEDDED_MODEL, unlisted)
    (tmp_path / "link").symlink_to(listed)
    from ui.lab import Lab
    from ui.state import preset_settings

    with pytest.raises(ValueError, match=r"is not on this class server's list \(PAL_ALLOWED_MODELS\)"):
        Lab.create(preset_settings("batch", model=str(listed)))
    class_mode.setenv(limits.ALLOWED_MODELS_ENV, str(listed))
    limits.check_spec(preset_settings("batch", model=str(listed)))  # what Lab.create checks first
    limits.check_spec(preset_settings("batch", model=str(tmp_path / "link") + "/"))  # another spelling of it
    limits.check_spec(preset_settings("batch", model=EMBEDDED_MODEL))  # the embedded model always
    with pytest.raises(ValueError, match=r"'.*unlisted' is not on this class server's list"):
        Lab.create(preset_settings("batch", model=str(unlisted)))
    via_link = load_shared(str(tmp_path / "link"))
    assert via_link is load_shared(str(listed)) and via_link is not loaded  # its own folder, one copy


def test_two_spellings_of_a_folder_are_one_cached_copy(tmp_path, loaded):
    link = tmp_path / "tiny"
    link.symlink_to(EMBEDDED_MODEL)
    spellings = [EMBEDDED_MODEL + "/", EMBEDDED_MODEL + "/../tiny_model", str(link), str(link) + "//"]
    assert all(load_shared(s) is loaded for s in spellings)
    from infra.runs import shared_model

    assert shared_model(str(link)) is shared_model(EMBEDDED_MODEL + "/")


def test_a_hub_download_above_the_cap_is_refused_before_the_weights(monkeypatch):
    """Outside class mode a hub model whose safetensors are larger than PAL_MAX_DOWNLOAD_MB is refused from the
    hub's file list, before anything large is fetched."""
    import huggingface_hub

    monkeypatch.delenv(limits.CLASS_SERVER_ENV, raising=False)
    monkeypatch.setenv(model_loader.MAX_DOWNLOAD_ENV, "512")
    sibling = type("S", (), {})
    files = []
    for name, size in (("model-00001.safetensors", 700 * MIB), ("model-00002.safetensors", 324 * MIB),
                       ("pytorch_model.bin", 4000 * MIB)):
        s = sibling()
        s.rfilename, s.size = name, size
        files.append(s)
    info = type("I", (), {"siblings": files})()
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, repo, files_metadata=False: info)
    monkeypatch.setattr(model_loader, "_in_hub_cache", lambda repo: False)
    with pytest.raises(ModelLoadError, match=r"model 'org/big': its weights are 1,024 MiB on the hub, more than "
                                             r"this server downloads \(512 MiB, PAL_MAX_DOWNLOAD_MB\)"):
        model_loader._check_hub_size("org/big")
    monkeypatch.setenv(model_loader.MAX_DOWNLOAD_ENV, "2048")
    model_loader._check_hub_size("org/big")  # under the cap: allowed


# ------------------------------------------------------------------------------ the app (AppTest)
def new_app() -> AppTest:
    at = AppTest.from_file(APP, default_timeout=180)
    at.run()
    assert not at.exception
    return at


def button(at, label):
    return next(b for b in at.button if b.label == label)


def test_the_model_field_offers_only_the_served_models(class_mode, tmp_path):
    listed = tmp_path / "listed"
    shutil.copytree(EMBEDDED_MODEL, listed)
    class_mode.setenv(limits.ALLOWED_MODELS_ENV, str(listed))
    at = new_app()
    assert not [t for t in at.text_input if t.label.startswith("Model")]  # nothing can be typed
    field = next(s for s in at.selectbox if s.label.startswith("Model"))
    # the two shipped models (hybrid-window's preset runs on the second), then the operator's list
    assert field.options == ["embedded tiny model", "embedded tiny hybrid model (hybrid-window)", str(listed.resolve())]


def test_the_history_is_bounded_and_the_page_says_so(class_mode):
    class_mode.setenv(limits.HISTORY_STEPS_ENV, "10")
    at = new_app()
    lab = at.session_state["lab"]
    assert lab.session.history_limit == 10
    for _ in range(13):
        button(at, "Step").click().run()
        assert not at.exception
    assert [paged.step for paged, _ in lab.run.history] == list(range(4, 14))  # the engines' own step numbers
    assert lab.session.dropped_steps == 3 and lab.steps_run == 13 == lab.run.paged.step_count
    notes = [i.value for i in at.info]
    assert ("Steps 1-3 were dropped to save memory; the run continues (this class server keeps the last 10 "
            "steps: 4-13).") in notes
    assert any(c.value.startswith("step 13 ") for c in at.caption)  # the step shown keeps its number


def test_trimming_keeps_the_cursor_on_its_step_and_arrivals_on_time(class_mode, loaded):
    from ui.lab import Lab
    from ui.state import preset_settings

    full = Lab.create(preset_settings("batch"), loaded)
    full.session.history_limit = None
    bounded = Lab.create(preset_settings("batch"), loaded)
    bounded.session.history_limit = 10
    for _ in range(30):
        full.step()
        bounded.step()
        if bounded.step_count == 10 and bounded.player.cursor == -1:
            bounded.seek(7)  # looking back at step 8
    assert [r.snapshot for r, _ in full.run.history[-10:]] == [r.snapshot for r, _ in bounded.run.history]
    assert bounded.player.cursor == 0  # step 8 was dropped: the oldest kept step is shown
    assert bounded.run.history[bounded.player.cursor][0].step == 21


def test_an_idle_session_is_released_and_comes_back_fresh(class_mode):
    from ui import class_server

    class_server.seat_registry()["seats"].clear()
    at = new_app()
    lab = at.session_state["lab"]
    button(at, "Step").click().run()
    now = time.monotonic()
    got = limits.class_limits()
    class_server.sweep(got, now + 19 * 60)  # 19 idle minutes: kept
    assert lab.run.paged is not None
    lab.step()  # it stepped without a script run of app.py (Play's fragment): active again
    class_server.sweep(got, now + 30 * 60)
    assert lab.run.paged is not None
    assert class_server.sweep(got, now + 51 * 60)  # 21 minutes after that activity: released
    assert lab.run.paged is None and lab.run.contiguous is None and lab.run.history == []
    at.run()
    assert not at.exception
    fresh = at.session_state["lab"]
    assert fresh is not lab and fresh.run.paged is not None and fresh.step_count == 0
    assert any("released after 20 idle minutes" in i.value for i in at.info)


# ------------------------------------------------------------------------------ no internet (a browser)
@pytest.fixture(scope="module")
def class_url():
    """`streamlit run app.py` as a class server (offline) on a free localhost port; its base URL."""
    from conftest import serve_app

    yield from serve_app({limits.CLASS_SERVER_ENV: "1"})


@pytest.mark.browser
def test_the_page_requests_nothing_from_outside_the_server(class_url):
    from conftest import CHROMIUM

    if not os.path.exists(CHROMIUM):
        pytest.skip("Chromium is not installed")
    from playwright.sync_api import sync_playwright

    requests = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1280, "height": 720})
        page.on("request", lambda r: requests.append(r.url))
        page.goto(class_url, wait_until="networkidle")
        page.locator(".st-key-stage_step button").first.wait_for(timeout=120_000)
        page.locator(".st-key-stage_step button").first.click()
        page.wait_for_timeout(3000)
        for title in ("Compare", "All lessons"):  # other pages: their figures and icons
            page.get_by_role("link", name=title).first.click()
            page.wait_for_load_state("networkidle")
            page.wait_for_timeout(2000)
        icon = page.evaluate("() => [...document.querySelectorAll(\"link[rel~='icon']\")].map(l => l.href)")
        browser.close()
    host = urlparse(class_url).netloc
    outside = sorted({u for u in requests if urlparse(u).scheme in ("http", "https", "ws", "wss")
                      and urlparse(u).netloc != host})
    assert not outside, outside
    assert len(requests) > 10  # the page did load its scripts, styles and data
    assert icon and all(urlparse(u).netloc == host for u in icon), icon


def test_a_scenario_file_over_the_request_cap_is_refused_whole(monkeypatch):
    """A class server refuses a file with more requests than its cap when the lab is built (nothing queued),
    not at the arrival step where the cap would be reached."""
    from engine.scenarios.scenario_file import load_preset
    from ui.lab import Lab
    from ui.state import scenario_settings

    monkeypatch.setenv(limits.CLASS_SERVER_ENV, "1")
    cap = limits.class_limits().max_requests
    one = load_preset("single")
    request = one.requests[0]
    many = one.model_copy(update={"name": "many", "requests": [request.model_copy(update={"arrival_step": i})
                                                               for i in range(cap + 1)]})
    with pytest.raises(ValueError, match=f"at most {cap} requests"):
        Lab.create(scenario_settings(many, EMBEDDED_MODEL), load_shared(EMBEDDED_MODEL))

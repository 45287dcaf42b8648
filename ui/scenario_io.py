"""Scenario files and links in the Playground: the run on screen saved as a JSON or YAML file
(``engine.scenarios.scenario_file``), a file opened from disk, and the page's URL kept as a link to the same run.

The link is two query parameters next to the lessons' ``progress`` (which ``lessons.render.sync_progress_url``
writes on every page and this module never touches):

- ``scenario``: a shipped preset's name when the lab runs that preset as shipped (its own settings, nothing
  added by hand), else the whole scenario packed (``engine.scenarios.scenario_file.encode_link``: the file's JSON without
  defaults, zlib, base64url, at most ``MAX_LINK_CHARS``);
- ``step``: the engine step on screen (0 before the first).

Opening such a URL on a fresh server (``open_scenario_link``, the first Playground run of a session) builds the
lab for that scenario and runs that many steps (at most ``MAX_LINK_STEPS``), so the same run appears: the
engines are deterministic given the requests' seeds (a sampled request saved without one gets the seed the paged
engine drew; the baseline drew its own, so for such a request only the paged side repeats exactly).
``scenario_sidebar`` keeps the URL in step with the lab on every full run of the page (after Apply, a request
added, Step, Back, the slider; while Play runs, the views re-run alone and the URL catches up at Pause) and draws
the sidebar's download, upload and link.

What a link cannot carry: the model (a link opens on the embedded model; its token ids are that tokenizer's)
and a run too big for ``MAX_LINK_CHARS`` (then the sidebar says so: save the file instead).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time

import streamlit as st

from engine import EMBEDDED_MODEL
from engine.scenarios.scenario_file import (ScenarioFile, ScenarioSettings, decode_link, dump_scenario, encode_link,
                                  from_workload, parse_text)
from engine.scenarios.presets import SCENARIOS
from engine.scenarios.workloads import Workload

from infra import class_limits
from engine.scenarios.run_spec import RunSpec

from .lab import Lab, fit_semantics
from .state import build_lab, get_lab, preset_settings, scenario_settings

LINK_PARAM = "scenario"
STEP_PARAM = "step"
KEPT = "the Playground keeps the run it had"  # after a refused scenario file (a refused link: the default preset)
MAX_LINK_STEPS = 2000  # steps a link may ask to run when it opens (seconds on the embedded model)
OPENED = "scenario_link_opened"  # the session's first Playground run has read the URL
ERROR = "scenario_error"  # what went wrong opening a link or a file, said once on the next run


# --------------------------------------------------------------------------------- the lab as a scenario
def lab_scenario(lab: Lab) -> ScenarioFile:
    """The lab's run as a scenario file: its settings in effect (a pool sized by a KV budget as the blocks it
    got), every request added so far at the step it arrived with its priority, then those still to arrive.
    A sampled request without a seed gets the one the paged engine drew, so the file runs the same tokens.
    Raises ValueError if the run cannot be a file (e.g. more than ``MAX_REQUESTS`` requests)."""
    settings = lab.run.settings
    fields = {k: getattr(settings, k) for k in ScenarioSettings.model_fields}
    if settings.kv_budget_mb > 0 and lab.run.paged is not None:
        fields["num_blocks"] = lab.run.paged.num_blocks
    requests = [_with_seed(lab, rid, r) for rid, r in list(lab.run.arrivals)] + [r for r, _ in list(lab.run.pending)]
    if settings.preset != "custom":
        name, description = settings.preset, SCENARIOS[settings.preset].description
    elif settings.scenario is not None:
        name, description = settings.scenario.name, settings.scenario.description
    else:
        name, description = "custom", "requests added by hand in the Playground"
    workload = Workload(name, settings.seed, requests, description)
    return from_workload(workload, fields, settings.semantics)


def _with_seed(lab: Lab, rid: str, request):
    """``request`` with the seed the paged engine drew for it, when it samples without one of its own."""
    params = request.params
    if params.seed is not None or params.greedy or params.beam_width > 1 or lab.run.paged is None:
        return request
    engine_request = lab.run.paged.requests.get(rid) or lab.run.paged.requests.get(f"{rid}.0")  # V1: n child requests
    if engine_request is None:
        return request
    return dataclasses.replace(request, params=dataclasses.replace(params, seed=engine_request.seed))


def runs_shipped_preset(lab: Lab) -> bool:
    """Whether the lab runs a shipped preset as shipped: its own settings (model aside) and nothing added by
    hand, so its name alone is the link."""
    s = lab.run.settings
    if s.preset == "custom" or len(lab.run.arrivals) + len(lab.run.pending) != lab.run.queued:
        return False
    shipped, _ = fit_semantics(preset_settings(s.preset, s.model))
    return s == shipped


def shown_step(lab: Lab) -> int:
    """The engine step on screen (0 before the first step)."""
    history, index, _ = lab.frame()
    return history[index][0].step if index >= 0 else 0


def link_query(lab: Lab, scenario: ScenarioFile | None = None) -> dict[str, str]:
    """The query parameters that open this lab's run at the step on screen (``scenario``: ``lab_scenario(lab)``
    when already made). Raises ValueError if the scenario is too big for a link (``encode_link``) or cannot be
    a file."""
    if runs_shipped_preset(lab):
        value = lab.run.settings.preset
    else:
        value = encode_link(scenario if scenario is not None else lab_scenario(lab))
    return {LINK_PARAM: value, STEP_PARAM: str(shown_step(lab))}


# ------------------------------------------------------------------------------------------ opening a link
def link_settings(value: str, model: str = EMBEDDED_MODEL) -> RunSpec:
    """The Playground settings a link's ``scenario`` value opens: a preset's name, or a packed scenario
    (``decode_link``). Raises ValueError naming what is wrong."""
    value = value.strip()
    if value in SCENARIOS:
        return preset_settings(value, model)
    try:
        scenario = decode_link(value)
    except ValueError:
        if looks_like_a_name(value):  # not a packed scenario (they start "eN", zlib's header): a preset's name
            raise ValueError(no_such_preset(value)) from None
        raise
    class_limits.check_scenario_request_count(scenario, "link")  # a class server's cap, when it is opened
    return scenario_settings(scenario, model)


def read_file(raw: str | bytes, fmt: str | None = None) -> ScenarioFile:
    """A scenario file's text as the page opens it: ``parse_text``, then a class server's request cap
    (``class_limits.check_scenario_request_count``). Raises ValueError naming what is wrong."""
    scenario = parse_text(raw, fmt)
    class_limits.check_scenario_request_count(scenario, "file")
    return scenario


def looks_like_a_name(value: str) -> bool:
    """Whether a link's ``scenario`` value reads as a preset's name rather than a packed scenario: a short
    word of letters, digits, "-" and "_" that does not start with a zlib header in base64 (every packed
    scenario does: ``engine.scenarios.url_codec.pack``; "eN" at its level, "eJ" at zlib's default, and so on)."""
    return len(value) <= 40 and re.fullmatch(r"[A-Za-z0-9_-]+", value) is not None and not _zlib_header(value)


def _zlib_header(value: str) -> bool:
    """Whether ``value``'s first 4 base64 characters decode to a zlib stream's header (RFC 1950: method 8,
    a window of at most 32 KiB, and CMF * 256 + FLG a multiple of 31)."""
    import base64
    import binascii

    try:
        head = base64.urlsafe_b64decode(value[:4])
    except (binascii.Error, ValueError):
        return False
    return len(head) >= 2 and head[0] & 0x0F == 8 and head[0] >> 4 <= 7 and (head[0] * 256 + head[1]) % 31 == 0


def no_such_preset(name: str) -> str:
    """Names the missing preset, the closest one if any, and every preset a link may name."""
    import difflib

    close = difflib.get_close_matches(name.lower(), list(SCENARIOS), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (f"there is no preset named {name!r}{hint}; the presets are: {', '.join(SCENARIOS)} (a link names "
            f"one of them, or holds a whole scenario the Playground packed)")


def link_steps(value: str | None) -> int:
    """A link's ``step`` value as a number of steps to run (absent: 0). Raises ValueError naming the value
    unless it is a whole number from 0 to ``MAX_LINK_STEPS``: out of range (below 0, or above however many
    digits it has: never handed to ``int`` whole) or not a number; the caller then opens the run at step 0."""
    if value is None or value.strip() == "":
        return 0
    value = value.strip()
    at_zero = "the scenario opened at step 0 (press Step, or Play, to go on)"
    number = re.fullmatch(r"([+-]?)0*([0-9]+)", value)
    if number is None:
        raise ValueError(f"step {value[:20]!r} is not a whole number of steps (a link runs 0 to "
                         f"{MAX_LINK_STEPS:,}); {at_zero}")
    sign, digits = number.groups()
    if len(digits) > 15:  # shown by its length: never int() a number typed by anyone whole
        shown = f"{digits[:6]}... (a number of {len(digits):,} digits)"
    else:
        shown = f"{int(digits):,}"
    if sign == "-" and digits != "0":
        raise ValueError(f"step -{shown} is out of range: a link's step counts from 0 (the run's start) to "
                         f"{MAX_LINK_STEPS:,}; {at_zero}")
    if len(digits) > 15 or int(digits) > MAX_LINK_STEPS:
        raise ValueError(f"step {shown} is more than the {MAX_LINK_STEPS:,} steps a link may run (out of range); "
                         f"{at_zero}")
    return int(digits)


def open_scenario_link() -> None:
    """At the start of the Playground's first run in a session: a URL with ``?scenario=`` (and ``&step=``)
    builds that scenario's lab and runs that many steps, so the same run appears. A bad link leaves the
    usual lab and says why (``ERROR``); a link asking for more steps than the run has stops at its end and
    says so."""
    if st.session_state.get(OPENED):
        return
    st.session_state[OPENED] = True
    value = st.query_params.get(LINK_PARAM)
    if not value:
        return
    try:
        settings = link_settings(value)
    except ValueError as exc:
        st.session_state[ERROR] = (f"This link's scenario {value[:40]!r} cannot be opened: {exc}; the Playground "
                                   f"shows its default preset instead")
        return
    try:
        steps = link_steps(st.query_params.get(STEP_PARAM))
    except ValueError as exc:
        st.session_state[ERROR] = f"This link's step cannot be opened: {exc}."
        steps = 0
    if not build_lab(settings):  # said here: the default lab built next would clear build_lab's lab_error
        st.session_state[ERROR] = (f"This link's scenario cannot be opened: {st.session_state.pop('lab_error', '')}; "
                                   f"the Playground shows its default preset instead")
        return
    lab = get_lab()
    ran = run_steps(lab, steps)
    if ran < steps and lab.run.failure is None:
        st.session_state[ERROR] = (f"This link asks for step {steps:,}, but the run ends at step {ran:,}: "
                                   f"showing step {ran:,}.")


PROGRESS_EVERY_S = 0.5  # the replay's progress bar is redrawn at least this often (seconds)


def run_steps(lab: Lab, steps: int) -> int:
    """Run up to ``steps`` steps of a fresh lab (fewer if its work ends first, a step fails, which the page
    then shows as the lab's ``failure``, or the lab is released), with a progress bar when there are many.
    Returns the steps run.

    The bar is redrawn every 25 steps and at least every ``PROGRESS_EVERY_S`` seconds: each redraw is a
    Streamlit call, where Streamlit stops a script run whose tab has closed, so a closed tab's replay stops
    within a step or so instead of running on (a heavy link's 25 steps took over a minute in a full class)."""
    bar = st.progress(0.0, text=f"Running the link's {steps:,} steps...") if steps > 50 else None
    drawn = time.monotonic()
    try:
        for i in range(steps):
            if lab.run.paged is None or not lab.has_work():  # released (its tab closed), or done
                break
            try:
                lab.step()
            except Exception:  # noqa: BLE001 - the lab keeps the failure; the page says it
                break
            if bar is not None and (i % 25 == 0 or time.monotonic() - drawn >= PROGRESS_EVERY_S):
                bar.progress(i / steps, text=f"Running the link's steps: {i:,} of {steps:,}")
                drawn = time.monotonic()
    finally:
        if bar is not None:
            bar.empty()
    return lab.steps_run


# -------------------------------------------------------------------------------------------- the sidebar
def scenario_sidebar(lab: Lab) -> None:
    """Keep the URL on this run and step (``sync_scenario_url``) and draw the sidebar's "Scenario file and
    link": download the run as JSON or YAML, open a file, and the link to copy."""
    try:
        scenario, why_no_file = lab_scenario(lab), None
    except ValueError as exc:
        scenario, why_no_file = None, str(exc)
    why_no_link = sync_scenario_url(lab, scenario)
    if err := st.session_state.pop(ERROR, None):
        st.error(err)
    with st.sidebar.expander("Scenario file and link", icon=":material/share:"):
        if why_no_file:
            st.caption(f"This run cannot be saved as a scenario: {why_no_file}")
        if scenario is not None:
            added = len(scenario.requests) - lab.run.queued
            st.caption(f"Scenario **{scenario.name}**: {len(scenario.requests)} request"
                       f"{'s' * (len(scenario.requests) != 1)}" + (f", {added} added by hand" if added > 0 and
                                                                    lab.run.queued else "")
                       + ". Save it, edit it, open it again, or share the link below.")
            stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", scenario.name).strip("-.") or "scenario"
            c1, c2 = st.columns(2)
            # the text is made when clicked (a callable): YAML of 32 token-id prompts takes 0.2 s on 2 cores
            c1.download_button("Save JSON", functools.partial(dump_scenario, scenario, "json"),
                               file_name=f"{stem}.json",
                               mime="application/json", on_click="ignore", key="scenario_save_json",
                               width="stretch")
            c2.download_button("Save YAML", functools.partial(dump_scenario, scenario, "yaml"),
                               file_name=f"{stem}.yaml",
                               mime="application/yaml", on_click="ignore", key="scenario_save_yaml",
                               width="stretch")
        gen = st.session_state.get("lab_generation", 0)
        key = f"scenario_upload_{gen}"  # a fresh uploader for every new lab, so a file is applied once
        st.file_uploader("Open a scenario file", type=["json", "yaml", "yml"], key=key, on_change=_uploaded,
                         args=(key,), max_upload_size=1,  # MB; parse_text refuses more than 256 KiB by name
                         help="A scenario file (JSON or YAML, at most 256 KiB) saved here or written by hand: "
                              "settings, requests with arrival steps, seed. It replaces the run.")
        if why_no_link:
            st.caption(f"No link for this run: {why_no_link}")
        else:
            # a step re-runs only the stage (a fragment), not this sidebar: say which step this link holds
            st.caption(f"Link to this run at step {st.query_params.get(STEP_PARAM, '0')}, the step when this sidebar "
                       f"was last drawn (it opens the same run on any server of this app). For the step on screen "
                       f"now, copy the browser's address: it follows every step.")
            st.code(page_link(), language=None, wrap_lines=True)
        if lab.run.settings.model != EMBEDDED_MODEL:
            st.caption("A link does not carry the model: it opens on the embedded model (a file opened here runs "
                       "on the model in effect).")


def sync_scenario_url(lab: Lab, scenario: ScenarioFile | None = None) -> str | None:
    """Write ``scenario`` and ``step`` for this run into the page's URL (only when they changed; ``progress``
    and any other parameter are left alone). Returns why there is no link (the parameters are then removed, so
    the URL never opens another run), or None."""
    try:
        query = link_query(lab, scenario)
    except ValueError as exc:
        for name in (LINK_PARAM, STEP_PARAM):
            if name in st.query_params:
                del st.query_params[name]
        return str(exc)
    for name, value in query.items():
        if st.query_params.get(name) != value:
            st.query_params[name] = value
    return None


def follow_step(lab: Lab) -> None:
    """The URL's ``step`` follows the step on screen, in the stage's fragment runs (a step re-runs only the
    stage, so ``sync_scenario_url``, which writes the scenario too, runs on the page's full runs). No link
    (no ``scenario`` in the URL): nothing to follow."""
    if LINK_PARAM in st.query_params:
        step = str(shown_step(lab))
        if st.query_params.get(STEP_PARAM) != step:
            st.query_params[STEP_PARAM] = step


def page_link() -> str:
    """The page's URL with this run's ``scenario`` and ``step`` (what ``sync_scenario_url`` wrote)."""
    from urllib.parse import urlencode

    query = urlencode({name: st.query_params.get(name, "") for name in (LINK_PARAM, STEP_PARAM)})
    base = (getattr(st.context, "url", None) or "").split("?")[0]
    return f"{base}?{query}"


def _uploaded(key: str) -> None:
    """A scenario file was chosen (the uploader's callback, before the page is drawn): validate it and build
    its lab, on the model in effect; a bad file is said, naming the field, and the lab stays."""
    upload = st.session_state.get(key)
    if upload is None:
        return
    fmt = "yaml" if upload.name.lower().endswith((".yaml", ".yml")) else "json" \
        if upload.name.lower().endswith(".json") else None
    lab = get_lab()
    try:
        scenario = read_file(upload.getvalue(), fmt)
        settings = scenario_settings(scenario, lab.run.settings.model if lab is not None else EMBEDDED_MODEL)
    except ValueError as exc:
        st.session_state[ERROR] = f"{upload.name} cannot be opened: {exc}; {KEPT}"
        return
    if not build_lab(settings):  # the previous lab stays
        st.session_state[ERROR] = f"{upload.name} cannot be opened: {st.session_state.pop('lab_error', '')}; {KEPT}"

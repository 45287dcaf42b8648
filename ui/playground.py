"""Playground: step a real model through prefill and decode and watch the paged pool next to the
contiguous baseline. Every number shown is read from the engines' StepRecords.

The paged engine runs the paper's semantics (vLLM V0) or vLLM V1's (the sidebar's "Semantics", applied with
the other settings); the line under the title always names the one on screen, and the contiguous baseline
always runs the paper's scheduler."""

from __future__ import annotations

import html

import pandas as pd
import streamlit as st

from engine import EngineConfig, SamplingParams, metrics
from engine.config import (CONTIGUOUS_POLICIES, DEFAULT_MAX_NUM_BATCHED_TOKENS_V1, PREEMPTION_MODES,
                           SCHEDULING_POLICIES, SEMANTICS)
from engine.request_queue import REQUEST_QUEUES
from engine.scenarios.presets import SCENARIOS
from ui import class_server, presenter
from ui.exports import export_panel
from engine.scenarios.run_spec import RunSpec, count_only_tokenizer
from ui.lab import (MAX_RUN_STEPS, POLICY_LABELS, POLICY_RESERVES, SCHEDULING_LABELS, SEMANTICS_LABELS,
                    engine_semantics_line)
from ui.scenario_io import follow_step, open_scenario_link, scenario_sidebar
from ui.stage_gate import stage_slot
from infra.keys import OPEN_PRESET
from ui.state import (applied_settings, build_lab, default_settings, get_lab, overridden_fields,
                      pending_stage_presses, preset_settings, shared_model, stage_keys, take_stage_presses)
from viz import block_table_rows, swap_pool_figure, timeline_figure
from viz.colors import colour_key, request_color, request_id_of
from viz.stage import stage_step
from viz.steps import SEMANTICS_SHORT, latest_sequences, sharing_counts, step_label, step_tokens_figure

PRESET_DEFAULTS = {"block_size": 16, "num_blocks": 64, "max_model_len": 256}
BUDGET_HELP = ("vLLM V1's max_num_batched_tokens: the most tokens one engine step computes. Every running "
               "request's next decode token (one each) and the waiting requests' prompt tokens share it; a prompt "
               "longer than what is left is prefilled in chunks over several steps (chunked prefill), so one "
               "step can mix decode tokens and prefill chunks. vLLM's default is 2,048; a small budget (e.g. 16 "
               "or 32) shows chunks and mixed steps on these short prompts. vLLM V1 needs the budget to be at "
               "least max_num_seqs (every running request gets a token each step), so a budget below 256 also "
               "caps the running sequences at the budget.")


# ------------------------------------------------------------------------------------------------ sidebar
def semantics_choice(current: RunSpec) -> str:
    """The sidebar's semantics switch, above the settings form (outside it, so the form shows the settings
    of the semantics chosen); like every setting it takes effect with "Apply and reset"."""
    gen = st.session_state.get("lab_generation", 0)
    semantics = st.sidebar.radio(
        "Semantics", SEMANTICS, index=SEMANTICS.index(current.semantics), format_func=SEMANTICS_LABELS.get,
        horizontal=True, key=f"set_semantics_{gen}",
        help="How the paged engine schedules. Paper (vLLM V0, as the PagedAttention paper describes it): a step "
             "is a prefill or a decode step; n samples and beams fork and copy on write; preemption by recompute "
             "or swap. vLLM V1: one token budget per step shared by decode tokens and prefill chunks (chunked "
             "prefill, mixed steps); n samples run as child requests that share the prompt's blocks through the "
             "prefix cache; preemption by recompute only; FCFS or priority scheduling. The contiguous baseline "
             "always runs the paper's scheduler.")
    if semantics != current.semantics:
        st.sidebar.caption(f"{SEMANTICS_LABELS[semantics]} is not applied yet: press **Apply and reset**.")
    return semantics


def settings_form(current: RunSpec) -> None:
    semantics = semantics_choice(current)
    v1 = semantics == "v1"
    with st.sidebar.form("engine"):
        st.subheader("Engine")
        # keys change with every rebuilt lab, so the form always opens on the settings in effect (a value
        # typed but overridden by the preset does not linger)
        gen = st.session_state.get("lab_generation", 0)
        presets = ["custom"] + list(SCENARIOS)
        preset = st.selectbox("Preset", presets, index=presets.index(current.preset),
                              help="A scenario's requests, or 'custom' to add your own.", key=f"set_preset_{gen}")
        if current.preset != "custom":
            st.caption(f"Current preset **{current.preset}**: {SCENARIOS[current.preset].description}"
                       + v1_preset_note(current))
        model = class_server.model_input(current.model, key=f"set_model_{gen}")  # a class server: its list only
        c1, c2 = st.columns(2)
        block_size = c1.number_input("Block size", value=current.block_size, step=1, key=f"set_block_size_{gen}")
        num_blocks = c2.number_input("Pool (blocks)", value=current.num_blocks, step=1, key=f"set_num_blocks_{gen}")
        budget = st.number_input("or KV budget (MiB, 0 = use blocks)", value=float(current.kv_budget_mb),
                                 min_value=0.0, step=0.25, format="%.2f", key=f"set_kv_budget_{gen}")
        c3, c4 = st.columns(2)
        max_len = c3.number_input("Max model length", value=current.max_model_len, step=1, key=f"set_max_len_{gen}")
        reservation = c4.number_input("Contiguous reservation", value=current.reservation or current.max_model_len,
                                      step=1, key=f"set_reservation_{gen}")
        if v1:
            c5, c6 = st.columns(2)
            scheduling = c5.selectbox("Scheduling policy", SCHEDULING_POLICIES,
                                      index=SCHEDULING_POLICIES.index(current.scheduling_policy),
                                      format_func=SCHEDULING_LABELS.get, key=f"set_scheduling_{gen}",
                                      help="vLLM V1's scheduling policy: FCFS admits in arrival order and preempts "
                                           "the last admitted; priority admits the lowest priority value first "
                                           "(then arrival) and preempts the highest. Give a request a priority "
                                           "when you add it below.")
            tokens = c6.number_input("Token budget per step",
                                     value=current.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS_V1,
                                     step=16, key=f"set_token_budget_{gen}", help=BUDGET_HELP)
        caching = st.checkbox("Prefix caching", value=current.enable_prefix_caching, key=f"set_caching_{gen}")
        if v1:
            mode, swap = "recompute", 0
            st.caption("Preemption: **recompute only** in vLLM V1 (it has no swap pool; swap is the paper's, "
                       "choose Paper (vLLM V0) above for it).")
        else:
            mode = st.radio("Preemption", PREEMPTION_MODES, index=PREEMPTION_MODES.index(current.preemption_mode),
                            horizontal=True, key=f"set_preemption_{gen}",
                            help="The paper's (vLLM V0) two ways to evict a request when the pool runs out. vLLM "
                                 "V1 preempts by recompute only.")
            swap = st.number_input("Swap pool (blocks, 0 = as big as the pool)", value=current.swap_space_blocks or 0,
                                   step=1, key=f"set_swap_{gen}")
        seed = st.number_input("Seed", value=current.seed, min_value=0, step=1, key=f"set_seed_{gen}")
        policy = st.selectbox("Contiguous policy", CONTIGUOUS_POLICIES,
                              index=CONTIGUOUS_POLICIES.index(current.contiguous_policy),
                              format_func=POLICY_LABELS.get,
                              help="How much a request reserves on the contiguous baseline (the vLLM paper's "
                                   "baselines): " + "; ".join(f"{POLICY_LABELS[p]}: {POLICY_RESERVES[p]}"
                                                              for p in CONTIGUOUS_POLICIES)
                                   + ". Pow2 and Oracle learn each preset request's final length from a paged "
                                     "run first; requests added by hand then run on the paged engine only.", key=f"set_policy_{gen}")
        shown_watermark = round(current.effective_watermark * 100, 2)
        watermark = st.number_input("Watermark (% of the pool kept free at admission)",
                                    value=shown_watermark, min_value=0.0, max_value=99.0,
                                    step=0.5, format="%.1f",
                                    help="vLLM's watermark: admission leaves this share of the paged pool free, so "
                                         "a request just admitted is not preempted at once. 0 = use the exact pool. "
                                         "Defaults: 1% in the paper's semantics (vLLM V0), 0 in vLLM V1.",
                                    key=f"set_watermark_{gen}")
        use_preset = st.checkbox("Use the preset's pool settings", value=True,
                                 help="Take block size, pool and lengths from the preset instead, and any setting "
                                      "the preset fixes itself (e.g. prefix caching off, preemption by swap). "
                                      "A preset always runs with its own settings, whatever ran before: only what "
                                      "you change in this form applies on top of them.", key=f"set_use_preset_{gen}")
        if st.form_submit_button("Apply and reset", type="primary"):
            # what the widgets hold, in the form's units; only what differs from what the form opened with is a
            # choice (``applied_settings``): a preset is the same run whatever was applied before
            chosen = dict(model=model, block_size=int(block_size), num_blocks=int(num_blocks),
                          kv_budget_mb=float(budget), max_model_len=int(max_len), reservation=int(reservation),
                          enable_prefix_caching=bool(caching), seed=int(seed), contiguous_policy=policy,
                          watermark_pct=float(watermark), semantics=semantics)
            if v1:
                chosen.update(scheduling_policy=scheduling, max_num_batched_tokens=int(tokens))
            else:
                chosen.update(preemption_mode=mode, swap_space_blocks=int(swap))
            if ignored := overridden_fields(current, preset, chosen, use_preset=bool(use_preset)):
                st.session_state["flash_warning"] = (
                    f"{', '.join(f'{k} {chosen[k]!r}' for k in ignored)} not applied: taken from the preset "
                    f"{preset!r}, not from the form, because \"Use the preset's pool settings\" is ticked. Untick it "
                    f"to run your own values.")
            build_lab(applied_settings(current, preset, chosen, use_preset=bool(use_preset)))
            st.rerun()
    st.sidebar.caption(in_effect(current))


def in_effect(settings: RunSpec) -> str:
    """The settings the engines run with, in one line (the form may show values not applied yet)."""
    if settings.semantics == "v1":
        budget = settings.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS_V1
        policy = REQUEST_QUEUES[settings.scheduling_policy].short
        capped = settings.paged_max_num_seqs < EngineConfig.max_num_seqs  # a budget below 256 caps it
        cap = f", at most {settings.paged_max_num_seqs} running" if capped else ""
        semantics = f"vLLM V1 (token budget {budget:,}, {policy}{cap})"
    else:
        semantics = "the paper's semantics (vLLM V0)"
    return (f"In effect: **{settings.preset}**, {semantics}, blocks of {settings.block_size}, max length "
            f"{settings.max_model_len}, prefix caching {'on' if settings.enable_prefix_caching else 'off'}, "
            f"preemption by {settings.preemption_mode}, watermark {settings.effective_watermark:.1%}, contiguous "
            f"{POLICY_LABELS[settings.contiguous_policy]}.")


def v1_preset_note(settings: RunSpec) -> str:
    """What a preset's n samples become in vLLM V1 (its description tells the paper's story), or ""."""
    if settings.semantics != "v1" or settings.preset == "custom":
        return ""
    workload = SCENARIOS[settings.preset].make(settings.seed, count_only_tokenizer)
    n = max((r.params.n for r in workload.requests), default=1)
    if n <= 1:
        return ""
    return (f" In vLLM V1 the {n} samples run as {n} child requests (R1.0 .. R1.{n - 1}) that find the prompt's "
            f"full blocks in the prefix cache: no fork, no copy-on-write.")


def semantics_banner(lab) -> None:
    """The semantics of the engines on screen, always under the title; why V1 was not applied, if so."""
    st.markdown(f"**{engine_semantics_line(lab.run.paged)}**. The contiguous baseline runs the paper's scheduler.")
    # a switch chosen in the sidebar but not applied: said here too, where the audience looks
    chosen = st.session_state.get(f"set_semantics_{st.session_state.get('lab_generation', 0)}")
    if chosen in SEMANTICS_LABELS and chosen != lab.run.settings.semantics:
        st.caption(f"{SEMANTICS_LABELS[chosen]} is chosen in the sidebar but not applied yet: the run above is "
                   f"still {SEMANTICS_LABELS[lab.run.settings.semantics]}; press **Apply and reset** to switch.")
    if lab.run.semantics_note:
        st.warning(lab.run.semantics_note, icon=":material/info:")


def prefix_cache_reset(lab) -> None:
    """vLLM's ``reset_prefix_cache``: the engine refuses it while any request holds blocks."""
    if not st.sidebar.button("Reset prefix cache", width="stretch",
                             help="Forget every cached prefix (vLLM's reset_prefix_cache), so later requests compute "
                                  "their prompts afresh. Only while no request holds blocks."):
        return
    said = lab.reset_prefix_cache()  # between two steps, never during one
    if said is not None:
        after = ("The next step's record carries the event, and the hit rate starts again there (as vLLM's)."
                 if lab.has_work() else "Add a request to see it compute its prompt afresh.")
        st.sidebar.success(f"{said}. {after}")
    else:
        st.sidebar.warning("Reset refused: requests still hold blocks; reset when the pool is idle.")


def request_form(lab) -> None:
    with st.sidebar.form("add", clear_on_submit=False):
        st.subheader("Add a request")
        prompt = st.text_area("Prompt", "ROMEO. ", height=70)
        c1, c2 = st.columns(2)
        max_tokens = c1.number_input("max_tokens", value=24, step=1)
        temperature = c2.number_input("temperature", value=0.8, step=0.1, format="%.2f")
        c3, c4, c5 = st.columns(3)
        v1 = lab.run.paged.semantics == "v1"
        n = c3.number_input("n", value=1, step=1,
                            help="parallel samples: forks sharing the prompt's blocks (paper), child requests "
                                 "R<k>.0, R<k>.1, ... over the prefix cache (vLLM V1)")
        beam = c4.number_input("beams", value=1, step=1,
                               help="beam search: the paper's semantics only (vLLM V1 runs it outside the scheduler)")
        seed = c5.number_input("seed", value=0, step=1)
        priority = 0
        if v1:
            priority = st.number_input("priority (lower runs first under the priority policy)", value=0, step=1,
                                       help="vLLM V1's request priority; FCFS ignores it")
        if st.form_submit_button("Add request (also mid-run)"):
            try:
                params = SamplingParams(max_tokens=int(max_tokens), temperature=float(temperature), n=int(n),
                                        beam_width=int(beam), seed=int(seed))
                rid = lab.add_request(prompt, params, priority=int(priority))
                st.session_state["flash"] = f"added {rid}"
            except ValueError as exc:
                st.session_state["flash_error"] = str(exc)


# ------------------------------------------------------------------------------------------------- views
def tinted_text(seq, table_colors: str) -> str:
    """The sequence's tokens, each tinted by its logical block (alternating shades of its request colour)."""
    tokenizer = shared_model(get_lab().run.settings.model)[1]
    B = get_lab().run.paged.block_size
    parts = []
    for t, tok in enumerate(seq.token_ids):
        piece = html.escape(tokenizer.decode([tok])).replace("\n", "⏎")
        alpha = "55" if (t // B) % 2 == 0 else "99"
        weight = "700" if t >= seq.prompt_len else "400"
        parts.append(f'<span title="token {t}: logical block {t // B}, offset {t % B}" '
                     f'style="background:{table_colors}{alpha};font-weight:{weight}">{piece}</span>')
    return "".join(parts)


def token_locator(snap, B: int) -> tuple[str, int] | None:
    """The token pick: a sequence holding GPU blocks and a position in it (keyed widgets, kept while scrubbing
    and clamped to what the step shown holds). Returns ``(seq_id, position)`` for the block-table picture,
    which outlines the token's logical block, physical block and slot and says ``slot = physical x B + offset``
    (``B`` tokens a block); None while "none" is picked."""
    live = {s.seq_id: s for s in snap.sequences if s.status == "running" and s.block_table}
    options = ["none"] + list(live)
    if st.session_state.get("loc_seq") not in options:  # that sequence finished or is not there at this step
        st.session_state["loc_seq"] = "none"
    c1, c2 = st.columns([2, 1])
    seq_id = c1.selectbox("Where does token t live? (pick a sequence)", options, key="loc_seq")
    seq = live.get(seq_id)
    last = max(0, seq.num_tokens - 1) if seq else 0
    if st.session_state.get("loc_t", 0) > last:
        st.session_state["loc_t"] = last
    t = c2.number_input(f"token t (0..{last})", min_value=0, max_value=last, step=1, key="loc_t",
                        disabled=seq is None)
    return (seq_id, int(t)) if seq is not None else None


def open_requested_preset() -> None:
    """A lesson's "Open this in the Playground" leaves its preset in ``session_state[OPEN_PRESET]`` (the
    lessons do not import ui); build the lab for it here, once."""
    request = st.session_state.pop(OPEN_PRESET, None)
    if request is None:
        return
    try:
        settings = preset_settings(**request)
    except (TypeError, ValueError) as exc:
        st.session_state["lab_error"] = f"the lesson's preset {request!r} cannot be opened: {exc}"
        return
    build_lab(settings)  # starts paused


def main() -> None:
    open_requested_preset()
    open_scenario_link()  # a link's ?scenario=...&step=N: that run at that step (first run of a session)
    lab = get_lab()
    if lab is None:
        if not build_lab(default_settings()):
            class_server.lab_refused(st.session_state.get("lab_error"), key="playground_retry")  # + Try again
            st.stop()
        lab = get_lab()
    with stage_slot():  # a full run takes the presses first too, so that the sidebar's link shows their step
        run_presses(lab)
    present = presenter.presenting()
    if not present:  # the presenter view has no sidebar (hidden, its forms not drawn)
        settings_form(lab.run.settings)
        prefix_cache_reset(lab)
        request_form(lab)
    scenario_sidebar(lab)  # the run as a file and a link; keeps the URL on this run and step
    if err := st.session_state.pop("lab_error", None):
        st.error(f"Settings not applied: {err}")
    if err := st.session_state.pop("flash_error", None):
        st.error(f"Request not added: {err}")
    if msg := st.session_state.pop("flash", None):
        st.success(msg)
    if msg := st.session_state.pop("flash_warning", None):
        st.warning(msg)

    if not present:
        st.title("Playground")
        semantics_banner(lab)
    # Everything a step changes is one fragment: a press (Step, PageDown, a clicker, Back, the slider) re-runs
    # only it, not the sidebar's forms above (a class server steps many labs at once: issue 16's load goals).
    # Play re-runs it on a timer; each tick runs the steps that keep Play at its speed (``Lab.play_tick``).
    timer = timer_of(lab)
    st.fragment(run_every=1.0 / lab.player.speed if lab.player.playing else None)(stage)(lab, present, timer)


def stage(lab, present: bool, timer: tuple[bool, float | None]) -> None:
    """The stage (a fragment): the presses counted in the browser since the last run, each run once before
    anything is drawn; the press counter; the controls row; the views. ``timer``: (playing, speed) as the full
    run that made this fragment set its timer; when a press here changes them, or the presenter toggle flips,
    the whole page runs again (the timer and the sidebar belong to it). It runs in one of the process's stage
    slots (``ui.stage_gate``): a class stepping at once is served in order, a few at a time. A long press
    (Run to end, Next event: up to ``MAX_RUN_STEPS`` steps) runs before the slot is taken, and the Export
    panel (seconds to draw a GIF) after it is given back, so that neither holds the class up."""
    class_server.touch_seat()  # a class server: this session is active (app.py's keep_session does not run here)
    # replaced or released while idle (the page's full run builds a fresh one and says so), or the presenter
    # toggle flipped in a callback: the whole page runs again before anything of the old layout is drawn
    if lab is not get_lab() or lab.run.paged is None or presenter.presenting() != present:
        st.rerun(scope="app")
    if any(kind in LONG_PRESSES for kind in pending_presses(lab)):
        run_presses(lab)
    with stage_slot():
        run_presses(lab)
        st.session_state["playing"] = lab.player.playing  # a mirror for reading; the lab keeps it with the steps
        # the (invisible) press counter: keys and the stage's clicks, whatever has the focus; in the presenter
        # view it also sends the window's size (a rerun: never in the Playground's view, where it would wipe a
        # message)
        stage_keys(lab, want_viewport=present)
        if present:
            presenter.style_page()  # type sized to the window the counter reported
        controls(lab, present)
        if timer_of(lab) != timer:  # a press or the speed here changed Play (the toggle was checked above)
            st.rerun(scope="app")
        follow_step(lab)  # the URL's step follows the step on screen (the scenario part is the full run's)
        views(lab, present)
    if not present:
        # outside the slot: a GIF or an MP4 takes seconds to draw, and the class's Steps need not wait for it
        export_panel(lab)  # HTML / GIF / MP4 / PNG of the run, built only on click


def timer_of(lab) -> tuple[bool, float | None]:
    """What the stage fragment's timer depends on: whether Play runs, and at what speed (steps per second)."""
    return lab.player.playing, lab.player.speed if lab.player.playing else None


PLAY_SPEEDS = [0.5, 1, 2, 4, 8]  # steps per second Play offers (``Lab.play_tick`` keeps to them)
STAGE_KEYS_HELP = ("PageDown or a presenter's clicker, whatever has the focus; every press is one step, run in "
                   "order, none lost")


def controls(lab, present: bool = False) -> None:
    """Back / Step (Forward while replaying) / Next event / Run to the end / Play / Reset, the speed and the
    presenter toggle: the row above the views.

    Back, Step, Next event, Run to the end and Play are presses (``Lab.press``; the first four queued by their
    callbacks and run at the top of the stage, Play's toggle run in its callback), all before the row is drawn:
    each one is atomic (a step, a run of steps, a move of the cursor or a toggle of Play), or is ignored and
    said so. On a beam-search step Step first shows its beam selection and Back its copies again
    (``Lab.phases``): the button then reads "Selection". In a browser the stage's counter (``ui.state.stage_keys``) takes
    their clicks and the keys over and hands them to the lab in order."""
    said_ignored(lab, present)
    if lab.run.failure is not None:
        st.error(f"The engines stopped: {lab.run.failure}. Nothing more runs in this lab: press **Reset**.")
    history, index, has_work = lab.frame()
    total = len(history)
    st.session_state["cursor"] = lab.player.cursor  # a mirror for reading; the lab keeps the cursor with the steps
    # on stage the toggle's column is wider: "Presenter view" at the projector's 18 px wrapped over the frame's
    # border at 1280 (issue 24's trial); its label stays on one line (``ui.presenter.CSS``)
    c = st.columns([1.0, 1.2, 1.4, 1.4, 1.0, 1.0, 1.6, 2.2] if present else [1.0, 1.2, 1.4, 1.4, 1.0, 1.0, 2.2, 1.6],
                   vertical_alignment="center")
    c[0].button("Back", key="stage_back", on_click=_press, args=("back",), width="stretch", disabled=total < 2,
                help="Show the previous step (PageUp). Recorded, not re-run.")
    replaying = 0 <= index < total - 1
    # a beam step in its first phase: the next press shows its selection (``Lab.phases``), said on the button
    selection_next = total > 0 and lab.phase_of(history[index][0]) < lab.phases(history[index][0]) - 1
    c[1].button("Selection" if selection_next else "Forward" if replaying else "Step", key="stage_step",
                on_click=_press, args=("forward",), type="primary", width="stretch",
                help=f"Run one engine step, or while looking back, show the next recorded step; on a beam-search "
                     f"step, first show its beam selection ({STAGE_KEYS_HELP}).")
    c[2].button("Next event", key="stage_next", on_click=_press, args=("next",), width="stretch",
                help=f"Run to the next {lab.key_events_said()} (N); while looking "
                     f"back, show the next recorded one. At most {MAX_RUN_STEPS:,} steps per press.")
    c[3].button("Run to end", key="stage_end", on_click=_press, args=("end",), width="stretch",
                disabled=not has_work and not replaying,
                help=f"Run every step left, at once (at most {MAX_RUN_STEPS:,} per press); then scrub back with the "
                     f"slider.")
    c[4].button("Pause" if lab.player.playing else "Play", key="stage_play", on_click=_toggle_play, width="stretch",
                help=None if present else "Step automatically at the chosen speed (P)")  # on stage its tooltip
    # covered the first sentence (issue 24's trial)
    # Reset in its callback, before the stage takes its slot (under Pow2 / Oracle it first runs the requests
    # headless to learn their lengths); the stage then finds a new lab and the whole page runs again
    c[5].button("Reset", width="stretch", on_click=_reset, help="Rebuild the engines with the same settings")
    speed = c[6].select_slider("Speed (steps per second)", PLAY_SPEEDS, value=2, key="speed",
                               label_visibility="collapsed" if present else "visible",
                               format_func=lambda v: f"{v:g} steps/s")
    lab.set_play_speed(speed)
    with c[7]:
        presenter.toggle()


CLICKED = "stage_clicked"  # presses clicked on the buttons themselves, run by the stage (in its slot)
LONG_PRESSES = {"next", "end", "N", "E"}  # presses that may run many steps (the lab's and the browser's names)


def _press(kind: str) -> None:
    """Step / Back / Next event / Run to end clicked (a button's callback, before the page is drawn): one press,
    run by ``run_presses`` at the top of the stage (a callback runs before the stage takes its slot). In a
    browser the stage's counter takes the clicks over (``ui.state.stage_keys``); AppTest and the load test
    click the buttons directly."""
    st.session_state.setdefault(CLICKED, []).append(kind)


def pending_presses(lab) -> list[str]:
    """The presses not run yet: the browser's (its letters) and the clicked buttons' (the lab's names)."""
    return list(pending_stage_presses(lab)) + list(st.session_state.get(CLICKED, []))


def run_presses(lab) -> None:
    """The presses made since the last run, each once, in order (``Lab.press``: atomic, or ignored and said):
    those the browser's stage counted (``take_stage_presses``), then those ``_press`` queued."""
    take_stage_presses(lab)
    for kind in st.session_state.pop(CLICKED, []):
        lab.press(kind)


def _reset() -> None:
    lab = get_lab()
    if lab is not None:
        build_lab(lab.run.settings)


def said_ignored(lab, present: bool = False) -> None:
    """Presses that did nothing are said, once: a toast with how many and why; so is what a press did that
    the screen does not show (``Lab.protocol.notice``), in the Playground's view. The presenter view has no notice
    toast: it covered the first sentence and the block tables' title for seconds, and the line beside the
    step says it (``Lab.said_short_on``)."""
    seen = st.session_state.get("ignored_seen")
    if seen is None or seen[0] != lab.protocol.token:
        seen = (lab.protocol.token, 0)
    if lab.protocol.ignored > seen[1]:
        n = lab.protocol.ignored - seen[1]
        st.toast(f"{n} press{'es' * (n != 1)} ignored: {lab.protocol.ignored_why}.", icon=":material/block:",
                 duration="long" if lab.protocol.ignored_why.startswith("Next event") else "short")
    st.session_state["ignored_seen"] = (lab.protocol.token, lab.protocol.ignored)
    # what a press did that is not on screen (``Lab.protocol.notice``: "Next event" found no event left), said once
    told = st.session_state.get("notices_seen")
    if told is None or told[0] != lab.protocol.token:
        told = (lab.protocol.token, 0)
    if lab.protocol.notices > told[1] and not present:
        st.toast(lab.protocol.notice + ".", icon=":material/info:", duration="long")
    st.session_state["notices_seen"] = (lab.protocol.token, lab.protocol.notices)


def _toggle_play() -> None:
    """Play / Pause clicked: a press of the lab (``Lab.press("play")``; refused when nothing is left)."""
    lab = get_lab()
    if lab is not None:
        lab.press("play")
        st.session_state["playing"] = lab.player.playing


SCRUB_SET = "scrub_set"  # the slider's last positions set by the page (step numbers), newest last


def _scrubbed() -> None:
    """The slider moved: show that recorded step (its last position means: follow the latest step). Not when
    the same rerun carries a press and the value is one the page itself set before its last run: a browser
    pressing faster than the page redraws sends back the slider as it last drew it (a stale echo), and taking
    that for a drag undid a Back (Back x3, PageUp x2 showed four steps back)."""
    lab, value = get_lab(), st.session_state.get("scrub")
    if lab is None or not isinstance(value, int):
        return
    if pending_presses(lab) and value in st.session_state.get(SCRUB_SET, [])[:-1]:
        return
    lab.seek(value - 1)
    st.session_state["cursor"] = lab.player.cursor


def views(lab, present: bool = False) -> None:
    """Everything below the controls, for the step under the cursor (re-run on a timer while playing), drawn
    from one consistent reading of the lab (``Lab.frame``) taken after any step of this run; the presenter
    view's screen when ``present``."""
    advance_play(lab)
    history, index, has_work = lab.frame()
    total = len(history)
    if total == 0:
        nothing_yet(lab)
        return
    if present:  # no slider: the keys and the clicker move through the steps
        presenter.views(lab, history, index, has_work, shared_model(lab.run.settings.model)[1].decode)
        lab.play_drawn(history[index][0].step)  # drawn to the end (a run stopped early never gets here)
        return
    index = scrub(total, index)
    paged, contiguous = history[index]
    latest = history[-1][0].step  # the engines' step number (a class server may have dropped older records)
    st.caption(f"step {paged.step} of {latest} ({step_label(paged)}; {SEMANTICS_SHORT[paged.semantics]}); "
               f"{'replaying recorded steps' if index < total - 1 else 'latest'}"
               + ("; all requests finished" if presenter.finished_on(history, index, has_work) else ""))
    if said := lab.said_on(paged):  # what Next event found (none left), while its step is on screen
        st.caption(f"**{said}.**")
    if said := presenter.playing_line(lab):  # in the fragment: Play's timer redraws it with the rate
        st.caption(said)
    class_server.history_note(lab)  # a class server keeps the last steps only: say when older ones were dropped
    previous = history[index - 1][0] if index > 0 else None
    phase = phase_control(lab, paged)  # a beam step: which of its two moments every view below shows
    # the step read once for every view below (``viz.stage``: the presenter view and the exports read it so too)
    step = stage_step(paged, contiguous, previous, order=lab.run.order, decode=shared_model(lab.run.settings.model)[1].decode,
                      budget=lab.step_budget(), final_lengths=lab.contiguous_final_lengths(), phase=phase)
    metrics_row(lab, paged, contiguous, step.moment)
    if hybrid := step.hybrid_line(lab.bytes_per_block()):  # a hybrid model: its groups and what its windows save
        st.caption(f"**Hybrid model.** {hybrid}")
    st.caption(sharing_line(lab, history, index))
    pools(lab, step)
    step_in_words(step)
    tables_and_text(lab, step, [p for p, _ in history[: index + 1]])
    timeline(lab, history, index, paged, contiguous)
    lab.play_drawn(paged.step)  # Play's measured rate counts the steps the page drew (``Lab.play_rate``)


PHASE_LABELS = {0: "1 the copies", 1: "2 after beam selection"}


def _phase_chosen(lab, record) -> None:
    """The phase control moved (its callback): the lab shows that phase of ``record`` (``Lab.set_phase``)."""
    value = st.session_state.get("stage_phase")
    if value in PHASE_LABELS and value < lab.phases(record):
        lab.set_phase(record, value)


def phase_control(lab, record) -> int:
    """A beam step's phase (``Lab.phase_of``: 0 the copies, 1 after beam selection), shown and chosen here,
    one choice for the pool, the slot view, the block tables and the numbers; Step / PageDown and Back /
    PageUp move it too. Nothing is drawn for a step with one phase. Returns the phase to draw."""
    phase = lab.phase_of(record)
    if lab.phases(record) < 2:
        return phase
    st.session_state["stage_phase"] = phase  # set before the widget exists in this run: it shows the lab's
    st.segmented_control("This beam step", list(PHASE_LABELS), format_func=PHASE_LABELS.get, key="stage_phase",
                         on_change=_phase_chosen, args=(lab, record),
                         help="A beam-search step in its two moments: the copies (each beam wrote its token, "
                              "copying a shared block first), then the beam selection (the kept beams fork, the "
                              "pruned ones free their blocks). Step / PageDown shows the selection, Back / "
                              "PageUp the copies again.")
    return phase


def advance_play(lab) -> None:
    """While playing: one engine step per timer tick (``Lab.play_tick``, atomic); when the work is done, stop
    and redraw the whole page (so the button says Play again)."""
    if not lab.player.playing:
        return
    if not lab.play_tick():  # nothing left (or paused meanwhile): Play has stopped
        st.session_state["playing"] = False
        st.rerun()


def nothing_yet(lab) -> None:
    queued, added = len(lab.run.pending), len(lab.run.order)
    said = []
    if queued:
        by = "the preset" if lab.run.settings.preset != "custom" else "the scenario file or link"  # Preset: custom
        said.append(f"{queued} request{' is' if queued == 1 else 's are'} queued by {by}")
    if added:
        said.append(f"{added} request{' was' if added == 1 else 's were'} added")
    st.info("Nothing has run yet. Press **Step** (or PageDown) to run the first engine step"
            + (f"; {' and '.join(said)}." if said else "; add a request in the sidebar first."))
    for note in lab.run.notes:
        st.caption(note)


def scrub(total: int, index: int) -> int:
    """The time-travel slider over the recorded steps, on step ``index`` (0-based); returns it."""
    if total > 1:
        st.session_state["scrub"] = index + 1  # set before the slider exists in this run
        shown = st.session_state.get(SCRUB_SET, [])
        if not shown or shown[-1] != index + 1:
            st.session_state[SCRUB_SET] = (shown + [index + 1])[-4:]
        st.slider("Step", 1, total, key="scrub", on_change=_scrubbed,
                  help="Time travel over the recorded steps; the right end follows the latest step.")
    return index


def _slack(snap) -> str:
    """``metrics.slack_pct`` of a snapshot, or "-" when nothing is allocated."""
    return f"{metrics.slack_pct(snap):.1f}%" if metrics.slots_allocated(snap) else "-"


def metrics_row(lab, paged, contiguous, moment: dict | None = None) -> None:
    """The numbers of the step shown, each read from its record through ``engine.metrics``; of a beam step,
    those of the phase shown (``moment``: ``viz.presenter.phase_moment``), as the pictures below."""
    snap = moment["snapshot"] if moment else paged.snapshot
    # two labelled groups, so each label stays short enough to read at 1280 px (seven long labels were cut)
    left, right = st.columns([4, 3])
    left.caption("**Paged** block pool" + (f" ({moment['label']})" if moment and moment["label"] else ""))
    if contiguous is not None:
        right.caption(f"**Contiguous** baseline, {POLICY_LABELS[lab.run.settings.contiguous_policy]}")
    saving = metrics.hybrid_saving(snap, lab.bytes_per_block())
    if saving is not None and contiguous is None:
        right.caption(f"**Hybrid** model vs every layer full ({saving['bytes']:,} bytes saved)")
    m = list(left.columns(4)) + list(right.columns(3))
    m[0].metric("running", len(snap.running),
                help="running requests on the paged engine: in the paper's semantics a request may hold several "
                     "samples or beams; in vLLM V1 each of n samples is a child request of its own (R1.0, R1.1, ...)")
    m[1].metric("free blocks", f"{snap.num_free_blocks}/{snap.num_blocks}",
                help=f"free blocks / all blocks. vLLM's KV cache usage (its vllm:kv_cache_usage_perc gauge) is "
                     f"{metrics.kv_cache_usage_pct(snap):.1f}%: blocks not free over all blocks, where a free "
                     f"block that still holds a cached prefix counts as free")
    m[2].metric("slack", _slack(snap), help="unused slots in allocated blocks (last-block slack)")
    cache = metrics.prefix_cache_stats(snap.prefix_cache)
    if not lab.run.settings.enable_prefix_caching:
        rate = "off"
    else:
        rate = f"{cache['hit_rate_pct']:.1f}%" if cache["query_tokens"] else "-"
    m[3].metric("hit rate", rate,
                help=f"Prefix-cache hit rate: prompt tokens found in the prefix cache over prompt tokens looked up, "
                     f"first admissions only: "
                     f"{cache['hit_tokens']:,} of {cache['query_tokens']:,} tokens in {cache['requests']} admissions. "
                     f"Re-admissions after a preemption are counted apart (they mostly find their own freed "
                     f"blocks): {cache['readmission_hit_tokens']:,} hit tokens of "
                     f"{cache['readmission_query_tokens']:,} in {cache['readmissions']} re-admissions.")
    if saving is not None and contiguous is None:  # a hybrid model (no baseline): what its windows save, big
        bpb = lab.bytes_per_block()
        m[4].metric("blocks saved", f"{saving['blocks']}",
                    help=f"blocks the pool holds fewer than the same model with every layer full would "
                         f"(engine.metrics.hybrid_saving: a pool count, all-full blocks minus blocks held, a block "
                         f"two requests share counted once), {saving['bytes']:,} bytes. The sliding-window KV "
                         f"cache group's tables hold the null block (-1) where a window gave a block back; per "
                         f"request those null entries are {saving['by_sequence']}, which add up to more than the "
                         f"pool count when requests share a prefix that left the window")
        m[5].metric("held / all full", f"{saving['held']} / {saving['twin']}",
                    help=f"blocks the running requests hold now, in every KV cache group, and what the same model "
                         f"with every layer attending to everything would hold, in this pool's blocks of "
                         f"{bpb:,} bytes (a block holds one KV cache group's layers): {saving['held'] * bpb:,} bytes "
                         f"held, {saving['twin'] * bpb:,} with every layer full. vLLM would run the all-full model "
                         f"as one group whose blocks hold every layer: fewer, larger blocks, the same bytes")
    if contiguous is not None:
        cs = contiguous.snapshot
        m[4].metric("admitted", len(cs.running), help="running requests on the contiguous baseline (it never "
                                                      "preempts: admitted is running)")
        m[5].metric("waiting", len(cs.waiting), help="requests waiting at the door for a large enough gap")
        waste = metrics.contiguous_waste_now(cs.contiguous, lab.contiguous_final_lengths())
        m[6].metric("unused", _slack(cs),
                    help=f"reserved slots not (yet) holding a token: {waste['reserved_not_yet_used']:,} reserved "
                         f"for tokens still to come, {waste['internal']:,} reserved past a known final length "
                         f"(internal fragmentation); besides, {waste['external']:,} free slots in gaps too small "
                         f"for a reservation (external fragmentation). Policy "
                         f"{POLICY_LABELS[lab.run.settings.contiguous_policy]}: reserves "
                         f"{POLICY_RESERVES[lab.run.settings.contiguous_policy]}")


def pools(lab, step) -> None:
    """The paged block pool (left) and both memories slot by slot (right), with the colour key, of the moment
    ``step`` shows (``viz.stage.StageStep``: a beam step in the phase chosen, titled with that moment's
    blocks in use, this step's changed blocks outlined)."""
    snap = step.record.snapshot
    contiguous = step.contiguous
    order = lab.run.order
    left, right = st.columns(2)
    with left:
        st.subheader("Paged block pool")
        # outline what changed structurally (a plain write into a block with room is not outlined): below
        selected = st.selectbox("Highlight a request", ["none"] + order, key="selected")
        slot_mode = st.toggle("Slot view (one cell per token slot)", value=False, disabled=snap.num_blocks > 128,
                              key="slot_mode")
        # the title names the step and the semantics, so a downloaded image says what it shows
        st.plotly_chart(step.pool_figure(title="step {step}{label}, {semantics}: {used}/{blocks} blocks in "
                                               "use<br><sub>{kind}</sub>",
                                         selected=None if selected == "none" else selected, slot_mode=slot_mode),
                        width="stretch", key="pool")
        if snap.num_swap_blocks:
            st.plotly_chart(swap_pool_figure(snap, order), width="stretch", key="swap")
            st.caption(f"swapped out: {', '.join(snap.swapped) or 'none'}")
    with right:
        st.subheader("Same memory, slot by slot")
        st.plotly_chart(step.slots_figure(), width="stretch", key="paged_slots")
        if contiguous is not None:
            st.plotly_chart(step.region_figure(), width="stretch", key="region")
            for note in lab.run.notes:
                st.caption(note)
        else:
            st.info(" ".join(lab.run.notes) or "The contiguous baseline is not available for these settings.")
        st.caption(colour_key(snap, contiguous.snapshot.contiguous if contiguous is not None else None,
                              None if selected == "none" else selected, strips=True))


def sharing_line(lab, history, index: int) -> str:
    """How the paged engine shared blocks up to the step shown, counted from the recorded events: forks and
    copy-on-write copies (paper) or child requests and prefix-cache hits (vLLM V1)."""
    counts = sharing_counts([p for p, _ in history[: index + 1]])
    hits = f"{counts['hit_tokens']:,} prompt tokens found in the prefix cache"
    if counts["hit_seqs"]:
        hits += f" (by {', '.join(dict.fromkeys(counts['hit_seqs']))})"
    forks = f"{counts['forks']} fork{'s' * (counts['forks'] != 1)}, {counts['cow']} copy-on-write " \
            f"cop{'y' if counts['cow'] == 1 else 'ies'}"
    if lab.run.paged.semantics == "v1":
        kids = "; ".join(f"{parent} runs as {len(children)} child requests {', '.join(children)}"
                         for parent, children in lab.run.paged.parents.items())
        return (f"Sharing so far (vLLM V1): {kids + '; ' if kids else ''}{hits}; {forks} (V1 shares full "
                f"blocks only through the prefix cache).")
    return f"Sharing so far (paper, vLLM V0): {forks}; {hits}."


def step_in_words(step) -> None:
    """The step by its parts (decode tokens, prefill chunks), then the allocator's decisions, several of one
    kind said once ("7 sequences found the same 5 cached blocks"): ``viz.stage.StageStep.sentences``."""
    st.subheader("This step, in words")
    lines = step.sentences()
    st.markdown("\n".join(f"- {html.escape(x)}" for x in lines) or "nothing changed")


def tables_and_text(lab, step, records: list) -> None:
    """Block tables as a picture (each logical block's arrow to its physical block, this step's new blocks and
    copy-on-write, the picked token's slot), the same tables as rows below (folded), and each sequence's text
    tinted by logical block. ``step``: the paged step shown (``viz.stage.StageStep``: its moment's snapshot
    and events); ``records``: the paged steps up to it, so that the text of requests that finished earlier
    stays on screen."""
    decode = step.decode
    snap = step.record.snapshot
    selected = st.session_state.get("selected", "none")  # the pool's "Highlight a request"
    st.subheader("Block tables")
    if snap.sequences:  # a row per sequence (``block_table_rows``)
        picture = st.container()  # the picture first, the pick's widgets under it (they are read before it is drawn)
        token = token_locator(snap, snap.block_size)
        # a beam step in the phase shown (the copies, or the selection); a pick the moment does not hold is dropped
        figure = step.tables_figure(selected=None if selected == "none" else selected, token=token)
        picture.plotly_chart(figure, width="stretch", key="block_tables")
        # drawn only while open (a lazy expander): a table to serialise on every step otherwise
        rows_panel = st.expander("Block tables as rows (logical -> physical)", key="block_rows_open",
                                 on_change="rerun")
        if rows_panel.open:
            rows_panel.dataframe(pd.DataFrame(block_table_rows(snap, decode)), hide_index=True, width="stretch")

    st.subheader("Generated text (tokens tinted by logical block)")
    # one element for all sequences (a paragraph each): fewer elements to send on every step
    st.markdown("\n\n".join(f"**{seq.seq_id}** ({seq.status}) "
                              + tinted_text(seq, request_color(request_id_of(seq.seq_id), lab.run.order))
                              for seq in latest_sequences(records)), unsafe_allow_html=True)


def timeline(lab, history, index: int, paged, contiguous) -> None:
    """KV utilisation and running requests up to the step shown."""
    st.subheader("Over time")
    series = {"paged": [p for p, _ in history[: index + 1]]}
    if contiguous is not None:
        series["contiguous"] = [c for _, c in history[: index + 1] if c is not None]
    st.plotly_chart(timeline_figure(series, current_step=paged.step), width="stretch", key="timeline")
    st.plotly_chart(step_tokens_figure(series["paged"], budget=lab.step_budget(), current_step=paged.step,
                                       semantics=paged.semantics), width="stretch", key="step_tokens")

main()

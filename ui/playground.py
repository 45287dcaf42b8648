"""Playground: step a real model through prefill and decode and watch the paged pool next to the
contiguous baseline. Every number shown is read from the engines' StepRecords."""

from __future__ import annotations

import html

import pandas as pd
import streamlit as st

from engine import SamplingParams, metrics
from engine.config import CONTIGUOUS_POLICIES, PREEMPTION_MODES
from engine.scenarios import SCENARIOS
from lessons.render import OPEN_PRESET
from ui.lab import POLICY_LABELS, POLICY_RESERVES, LabSettings
from ui.state import build_lab, default_settings, get_lab, preset_settings, shared_model
from viz import (block_pool_figure, block_table_rows, contiguous_region_figure, paged_slots_figure,
                 swap_pool_figure, timeline_figure)
from viz.colors import colour_key, request_color, request_id_of

PRESET_DEFAULTS = {"block_size": 16, "num_blocks": 64, "max_model_len": 256}


# ------------------------------------------------------------------------------------------------ sidebar
def settings_form(current: LabSettings) -> None:
    with st.sidebar.form("engine"):
        st.subheader("Engine")
        # keys change with every rebuilt lab, so the form always opens on the settings in effect (a value
        # typed but overridden by the preset does not linger)
        gen = st.session_state.get("lab_generation", 0)
        presets = ["custom"] + list(SCENARIOS)
        preset = st.selectbox("Preset", presets, index=presets.index(current.preset),
                              help="A scenario's requests, or 'custom' to add your own.", key=f"set_preset_{gen}")
        if current.preset != "custom":
            st.caption(f"Current preset **{current.preset}**: {SCENARIOS[current.preset].description}")
        model = st.text_input("Model (embedded default, local path or hub id)", current.model, key=f"set_model_{gen}")
        c1, c2 = st.columns(2)
        block_size = c1.number_input("Block size", value=current.block_size, step=1, key=f"set_block_size_{gen}")
        num_blocks = c2.number_input("Pool (blocks)", value=current.num_blocks, step=1, key=f"set_num_blocks_{gen}")
        budget = st.number_input("or KV budget (MiB, 0 = use blocks)", value=float(current.kv_budget_mb),
                                 min_value=0.0, step=0.25, format="%.2f", key=f"set_kv_budget_{gen}")
        c3, c4 = st.columns(2)
        max_len = c3.number_input("Max model length", value=current.max_model_len, step=1, key=f"set_max_len_{gen}")
        reservation = c4.number_input("Contiguous reservation", value=current.reservation or current.max_model_len,
                                      step=1, key=f"set_reservation_{gen}")
        caching = st.checkbox("Prefix caching", value=current.enable_prefix_caching, key=f"set_caching_{gen}")
        mode = st.radio("Preemption", PREEMPTION_MODES, index=PREEMPTION_MODES.index(current.preemption_mode),
                        horizontal=True, key=f"set_preemption_{gen}")
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
        watermark = st.number_input("Watermark (% of the pool kept free at admission)",
                                    value=round(current.watermark * 100, 2), min_value=0.0, max_value=99.0,
                                    step=0.5, format="%.1f",
                                    help="vLLM's watermark: admission leaves this share of the paged pool free, so "
                                         "a request just admitted is not preempted at once. 0 = use the exact pool.", key=f"set_watermark_{gen}")
        use_preset = st.checkbox("Use the preset's pool settings", value=True,
                                 help="Take block size, pool and lengths from the preset instead, and any setting "
                                      "the preset fixes itself (e.g. prefix caching off, preemption by swap).", key=f"set_use_preset_{gen}")
        if st.form_submit_button("Apply and reset", type="primary"):
            fields = dict(block_size=int(block_size), num_blocks=int(num_blocks), max_model_len=int(max_len),
                          reservation=int(reservation), swap_space_blocks=int(swap) or None,
                          kv_budget_mb=float(budget))
            common = dict(enable_prefix_caching=caching, seed=int(seed), contiguous_policy=policy,
                          watermark=float(watermark) / 100, preemption_mode=mode)
            if use_preset and preset != "custom":
                # what the preset fixes (its engine_defaults) wins over the form's values, which may still be
                # the previous preset's
                own = {"enable_prefix_caching", "contiguous_policy", "watermark", "preemption_mode"}
                own &= set(SCENARIOS[preset].engine_defaults)
                build_lab(preset_settings(preset, model.strip(), **{k: v for k, v in common.items() if k not in own}))
            else:
                build_lab(LabSettings(model=model.strip(), preset=preset, **common, **fields))
            st.rerun()
    st.sidebar.caption(in_effect(current))


def in_effect(settings: LabSettings) -> str:
    """The settings the engines run with, in one line (the form may show values not applied yet)."""
    return (f"In effect: **{settings.preset}**, blocks of {settings.block_size}, max length {settings.max_model_len}, "
            f"prefix caching {'on' if settings.enable_prefix_caching else 'off'}, preemption by "
            f"{settings.preemption_mode}, watermark {settings.watermark:.1%}, contiguous "
            f"{POLICY_LABELS[settings.contiguous_policy]}.")


def prefix_cache_reset(lab) -> None:
    """vLLM's ``reset_prefix_cache``: the engine refuses it while any request holds blocks."""
    if not st.sidebar.button("Reset prefix cache", width="stretch",
                             help="Forget every cached prefix (vLLM's reset_prefix_cache), so later requests compute "
                                  "their prompts afresh. Only while no request holds blocks."):
        return
    if lab.paged.reset_prefix_cache():
        said = [e.message for e in lab.paged.log.events if e.kind == "reset_prefix_cache"]
        after = ("The next step's record carries the event, and the hit rate starts again there (as vLLM's)."
                 if lab.has_work() else "Add a request to see it compute its prompt afresh.")
        st.sidebar.success(f"{said[-1] if said else 'prefix cache reset'}. {after}")
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
        n = c3.number_input("n", value=1, step=1)
        beam = c4.number_input("beams", value=1, step=1)
        seed = c5.number_input("seed", value=0, step=1)
        if st.form_submit_button("Add request (also mid-run)"):
            try:
                params = SamplingParams(max_tokens=int(max_tokens), temperature=float(temperature), n=int(n),
                                        beam_width=int(beam), seed=int(seed))
                rid = lab.add_request(prompt, params)
                st.session_state["flash"] = f"added {rid}"
            except ValueError as exc:
                st.session_state["flash_error"] = str(exc)


# ------------------------------------------------------------------------------------------------- views
def tinted_text(seq, table_colors: str) -> str:
    """The sequence's tokens, each tinted by its logical block (alternating shades of its request colour)."""
    tokenizer = shared_model(get_lab().settings.model)[1]
    B = get_lab().paged.block_size
    parts = []
    for t, tok in enumerate(seq.token_ids):
        piece = html.escape(tokenizer.decode([tok])).replace("\n", "⏎")
        alpha = "55" if (t // B) % 2 == 0 else "99"
        weight = "700" if t >= seq.prompt_len else "400"
        parts.append(f'<span title="token {t}: logical block {t // B}, offset {t % B}" '
                     f'style="background:{table_colors}{alpha};font-weight:{weight}">{piece}</span>')
    return "".join(parts)


def token_locator(snap, B: int) -> None:
    live = [s for s in snap.sequences if s.block_table]
    if not live:
        return
    c1, c2 = st.columns([2, 1])
    seq = c1.selectbox("Where does token t live?", live, format_func=lambda s: s.seq_id, key="loc_seq")
    t = c2.number_input("token t", min_value=0, max_value=max(0, seq.num_tokens - 1), value=0, step=1, key="loc_t")
    logical, offset = divmod(int(t), B)
    if logical < len(seq.block_table):
        physical = seq.block_table[logical]
        st.write(f"token {t} -> logical block {t} // {B} = **{logical}**, offset {t} % {B} = **{offset}** -> "
                 f"physical block **{physical}** -> slot {physical} x {B} + {offset} = **{physical * B + offset}**")


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
    lab = get_lab()
    if lab is None:
        if not build_lab(default_settings()):
            st.error(st.session_state.get("lab_error"))
            st.stop()
        lab = get_lab()
    settings_form(lab.settings)
    prefix_cache_reset(lab)
    request_form(lab)
    if err := st.session_state.pop("lab_error", None):
        st.error(f"Settings not applied: {err}")
    if err := st.session_state.pop("flash_error", None):
        st.error(f"Request not added: {err}")
    if msg := st.session_state.pop("flash", None):
        st.success(msg)

    st.title("Playground")
    controls(lab)
    playing = st.session_state.get("playing", False)
    speed = st.session_state.get("speed", 2)
    # Play re-runs only the views below, on a timer (a fragment), one engine step per run.
    st.fragment(run_every=1.0 / speed if playing else None)(views)(lab)


def controls(lab) -> None:
    """Back / Step (Forward while replaying) / Reset / Play and the speed: the row above the views."""
    c = st.columns([1.6, 1.8, 1.1, 1.1, 3.4], vertical_alignment="center")
    total = lab.step_count
    cursor = st.session_state.get("cursor", -1)
    if c[0].button("Back", shortcut="PageUp", width="stretch", disabled=total < 2,
                   help="Show the previous step (PageUp). Recorded, not re-run."):
        st.session_state["cursor"] = max(0, (cursor if cursor >= 0 else total - 1) - 1)
        st.rerun()
    replaying = 0 <= cursor < total - 1
    if c[1].button("Forward" if replaying else "Step", type="primary", shortcut="PageDown", width="stretch",
                   help="Run one engine step, or while looking back, show the next recorded step "
                        "(PageDown, or a presenter's clicker)."):
        if cursor >= 0 and cursor < total - 1:
            st.session_state["cursor"] = cursor + 1  # replay forward through what was recorded
        elif lab.has_work():
            lab.step()
            st.session_state["cursor"] = -1
        st.rerun()
    if c[2].button("Reset", width="stretch", help="Rebuild the engines with the same settings"):
        build_lab(lab.settings)
        st.rerun()
    playing = st.session_state.get("playing", False)
    c[3].button("Pause" if playing else "Play", on_click=_toggle_play, width="stretch", shortcut="P",
                help="Step automatically at the chosen speed (P)")
    c[4].select_slider("Speed (steps per second)", [0.5, 1, 2, 4, 8], value=2, key="speed")


def _toggle_play() -> None:
    st.session_state["playing"] = not st.session_state.get("playing", False)


def _scrubbed() -> None:
    """The slider moved: show that recorded step (its last position means: follow the latest step)."""
    value, total = st.session_state["scrub"], get_lab().step_count
    st.session_state["cursor"] = -1 if value >= total else value - 1


def views(lab) -> None:
    """Everything below the controls, for the step under the cursor (re-run on a timer while playing)."""
    advance_play(lab)
    total = lab.step_count
    if total == 0:
        nothing_yet(lab)
        return
    index = scrub(total)
    paged, contiguous = lab.record(index)
    st.caption(f"step {paged.step} of {total} ({paged.kind}); "
               f"{'replaying recorded steps' if index < total - 1 else 'latest'}"
               + ("" if lab.has_work() else "; all requests finished"))
    metrics_row(lab, paged, contiguous)
    pools(lab, paged, contiguous)
    step_in_words(paged, contiguous)
    tables_and_text(lab, paged.snapshot)
    timeline(lab, index, paged, contiguous)


def advance_play(lab) -> None:
    """While playing: one engine step per timer tick; when the work is done, stop and redraw the whole page
    (so the button says Play again)."""
    if not st.session_state.get("playing"):
        return
    if lab.has_work():
        lab.step()
        st.session_state["cursor"] = -1
    else:
        st.session_state["playing"] = False
        st.rerun()


def nothing_yet(lab) -> None:
    st.info("Nothing has run yet. Press **Step** (or PageDown) to run the first engine step"
            + (f"; {len(lab.pending)} request{' is' if len(lab.pending) == 1 else 's are'} queued by the preset."
               if lab.pending else
               "; add a request in the sidebar first."))
    for note in lab.notes:
        st.caption(note)


def scrub(total: int) -> int:
    """The time-travel slider over the recorded steps; returns the 0-based index of the step to show."""
    cursor = st.session_state.get("cursor", -1)
    index = total - 1 if cursor < 0 else min(cursor, total - 1)
    if total > 1:
        st.session_state["scrub"] = index + 1  # set before the slider exists in this run
        st.slider("Step", 1, total, key="scrub", on_change=_scrubbed,
                  help="Time travel over the recorded steps; the right end follows the latest step.")
    return index


def _slack(snap) -> str:
    """``metrics.slack_pct`` of a snapshot, or "-" when nothing is allocated."""
    return f"{metrics.slack_pct(snap):.1f}%" if metrics.slots_allocated(snap) else "-"


def metrics_row(lab, paged, contiguous) -> None:
    """The numbers of the step shown, each read from its record through ``engine.metrics``."""
    snap = paged.snapshot
    # two labelled groups, so each label stays short enough to read at 1280 px (seven long labels were cut)
    left, right = st.columns([4, 3])
    left.caption("**Paged** block pool")
    if contiguous is not None:
        right.caption(f"**Contiguous** baseline, {POLICY_LABELS[lab.settings.contiguous_policy]}")
    m = list(left.columns(4)) + list(right.columns(3))
    m[0].metric("running", len(snap.running), help="running requests on the paged engine (a request may hold "
                                                   "several samples or beams)")
    m[1].metric("free blocks", f"{snap.num_free_blocks}/{snap.num_blocks}", help="free blocks / all blocks")
    m[2].metric("slack", _slack(snap), help="unused slots in allocated blocks (last-block slack)")
    cache = metrics.prefix_cache_stats(snap.prefix_cache)
    if not lab.settings.enable_prefix_caching:
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
    if contiguous is not None:
        cs = contiguous.snapshot
        m[4].metric("admitted", len(cs.running), help="running requests on the contiguous baseline (it never "
                                                      "preempts: admitted is running)")
        m[5].metric("waiting", len(cs.waiting), help="requests waiting at the door for a large enough gap")
        m[6].metric("unused", _slack(cs),
                    help=f"reserved slots not (yet) holding a token; policy "
                         f"{POLICY_LABELS[lab.settings.contiguous_policy]}: reserves "
                         f"{POLICY_RESERVES[lab.settings.contiguous_policy]}")


def pools(lab, paged, contiguous) -> None:
    """The paged block pool (left) and both memories slot by slot (right), with the colour key."""
    snap = paged.snapshot
    order = lab.order
    decode = shared_model(lab.settings.model)[1].decode
    left, right = st.columns(2)
    with left:
        st.subheader("Paged block pool")
        # outline what changed structurally (a plain write into a block with room is not outlined)
        changed = sorted({b for e in paged.events if e.kind != "append" for b in e.blocks})
        selected = st.selectbox("Highlight a request", ["none"] + order, key="selected")
        slot_mode = st.toggle("Slot view (one cell per token slot)", value=False, disabled=snap.num_blocks > 128,
                              key="slot_mode")
        st.plotly_chart(block_pool_figure(snap, order, decode=decode, highlight=changed,
                                          selected=None if selected == "none" else selected, slot_mode=slot_mode),
                        width="stretch", key="pool")
        if snap.num_swap_blocks:
            st.plotly_chart(swap_pool_figure(snap, order), width="stretch", key="swap")
            st.caption(f"swapped out: {', '.join(snap.swapped) or 'none'}")
    with right:
        st.subheader("Same memory, slot by slot")
        st.plotly_chart(paged_slots_figure(snap, order), width="stretch", key="paged_slots")
        if contiguous is not None:
            st.plotly_chart(contiguous_region_figure(contiguous.snapshot.contiguous, order),
                            width="stretch", key="region")
            for note in lab.notes:
                st.caption(note)
        else:
            st.info(" ".join(lab.notes) or "The contiguous baseline is not available for these settings.")
        st.caption(colour_key(snap, contiguous.snapshot.contiguous if contiguous is not None else None,
                              None if selected == "none" else selected, strips=True))


def step_in_words(paged, contiguous) -> None:
    """Each allocator decision of the step as the engine's own sentence; plain appends summed up in one."""
    st.subheader("This step, in words")
    lines = [e.message for e in paged.events if e.kind != "append"]
    appends = [e for e in paged.events if e.kind == "append"]
    if appends:
        lines.append(f"{len(appends)} sequence{'s' * (len(appends) != 1)} wrote {'their' if len(appends) != 1 else 'its'} "
                     "new token into a block with room "
                     f"({', '.join(f'{e.request_id}->{e.blocks[0]}' for e in appends[:12])}"
                     f"{', ...' if len(appends) > 12 else ''})")
    if contiguous is not None:
        lines += [f"contiguous: {e.message}" for e in contiguous.events if e.kind in ("wait", "allocate", "free")]
    st.markdown("\n".join(f"- {html.escape(x)}" for x in lines) or "nothing changed")


def tables_and_text(lab, snap) -> None:
    """Block tables, the token locator and each sequence's text tinted by logical block."""
    decode = shared_model(lab.settings.model)[1].decode
    st.subheader("Block tables")
    rows = block_table_rows(snap, decode)
    if rows:
        st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")
        token_locator(snap, snap.block_size)

    st.subheader("Generated text (tokens tinted by logical block)")
    for seq in snap.sequences:
        color = request_color(request_id_of(seq.seq_id), lab.order)
        st.markdown(f"**{seq.seq_id}** ({seq.status}) " + tinted_text(seq, color), unsafe_allow_html=True)


def timeline(lab, index: int, paged, contiguous) -> None:
    """KV utilisation and running requests up to the step shown."""
    st.subheader("Over time")
    series = {"paged": [p for p, _ in lab.history[: index + 1]]}
    if contiguous is not None:
        series["contiguous"] = [c for _, c in lab.history[: index + 1] if c is not None]
    st.plotly_chart(timeline_figure(series, current_step=paged.step), width="stretch", key="timeline")

main()

"""Compare: one workload run to completion on the paged engine and on the contiguous baseline under each of
its four reservation policies, in the same KV byte budget; their accounting side by side.

Settings come from the Playground's one path (``ui.state.preset_settings`` -> ``LabSettings.config``), so a
scenario's own engine settings (its pool, reservation, preemption mode, prefix caching) hold here too. The
paged run goes first: the final lengths it reaches (``learn_final_lengths``) are what "pow2" and "oracle"
must know in advance. Every number in the table is ``engine.cli``'s summary, built from ``engine.metrics``.
"""

from __future__ import annotations

import dataclasses

import pandas as pd
import streamlit as st

from engine import LLMEngine, metrics
from engine.cli import contiguous_summary, paged_summary
from engine.config import CONTIGUOUS_POLICIES, FINAL_LENGTH_POLICIES
from engine.scenarios import SCENARIOS
from engine.workloads import learn_final_lengths, run_workload
from ui.lab import POLICY_LABELS, POLICY_RESERVES, LabSettings
from ui.state import preset_settings, shared_model
from viz import contiguous_region_figure, paged_slots_figure, timeline_figure

ROWS = ["slots allocated / reserved", "slots used", "waste", "internal fragmentation (slots)",
        "external fragmentation (max, slots)", "peak concurrency", "KV utilisation (mean)",
        "requests that waited at the door", "engine steps",
        "prefix-cache hit rate (first admissions)", "re-admission hit tokens", "preemptions",
        "recompute share of prefill"]


def _tokenize(tokenizer):
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


def single_sequence_refusal(workload) -> str | None:
    """Why the contiguous baseline cannot run this workload (it serves one sequence per request), or None."""
    many = [r.params for r in workload.requests if r.params.num_seqs > 1]
    if not many:
        return None
    p = many[0]
    what = f"n={p.n} samples" if p.n > 1 else f"{p.beam_width} beams"
    return (f"the contiguous baseline serves one sequence per request, and this workload asks for {what} of "
            f"one prompt, which only paging can share (fork and copy-on-write). Step it in the Playground to see "
            f"the paged side.")


def run_all(name: str, seed: int) -> dict:
    """Run ``name`` on the paged engine, then on the contiguous baseline under every policy.

    Returns {"name", "seed", "settings", "paged": (records, summary), "policies": {policy: (records,
    summary)}, "skipped": {policy: reason}}. Raises ValueError (settings, or the paged engine refusing a
    request); a policy that cannot run is listed in "skipped" with the engine's reason.
    """
    settings: LabSettings = preset_settings(name, seed=seed)
    scenario = SCENARIOS[name]
    loaded = shared_model(settings.model)
    paged = LLMEngine(settings.config("paged"), loaded)
    workload = scenario.make(seed, _tokenize(paged.tokenizer))
    n = len(workload.requests)
    records: list = []
    with st.spinner(f"Running {n} request{'s' * (n != 1)} of {name} on the paged engine..."):
        outputs = run_workload(paged, workload, on_step=records.append)
    result = {"name": name, "seed": seed, "settings": settings,
              "paged": (records, paged_summary(paged, records, outputs)), "policies": {}, "skipped": {}}
    finals = learn_final_lengths(outputs)
    for policy in CONTIGUOUS_POLICIES:
        label = POLICY_LABELS[policy]
        records = []
        try:
            with st.spinner(f"Running the same {n} request{'s' * (n != 1)} on the contiguous baseline, {label}: "
                            f"it reserves {POLICY_RESERVES[policy]}..."):
                config = dataclasses.replace(settings, contiguous_policy=policy).config("contiguous")
                engine = LLMEngine(config, loaded)
                outputs = run_workload(engine, workload, on_step=records.append,
                                       final_lens=finals if policy in FINAL_LENGTH_POLICIES else None)
        except ValueError as exc:
            result["skipped"][policy] = str(exc)
            continue
        result["policies"][policy] = (records, contiguous_summary(engine, records, outputs))
    return result


def column(summary: dict, paged: bool, caching: bool) -> list[str]:
    """One allocator's values for ``ROWS``, formatted; every number from the run's summary."""
    pre = summary["preemption"]
    if paged:
        allocated, used = summary["slots_allocated"], summary["slots_used"]
        # slots of last blocks beyond the final lengths; no external fragmentation: any free block serves
        internal, external = metrics.internal_fragmentation(allocated, used), 0
        cache = summary["prefix_cache"]
        hit_rate = f"{cache['hit_rate_pct']:.1f}%" if caching else "off"
        readmission = f"{cache['readmission_hit_tokens']:,}" if caching else "off"
    else:
        allocated, used = summary["reserved_slots"], summary["used_slots"]
        internal, external = summary["internal_frag_slots"], summary["external_frag_slots"]
        hit_rate = readmission = "no prefix cache"
    return [f"{allocated:,}", f"{used:,}", f"{summary['waste_pct']:.1f}%", f"{internal:,}", f"{external:,}",
            str(summary["peak_concurrency"]), f"{summary['kv_utilization']:.1f}%", str(summary["queued_at_door"]),
            str(summary["steps"]), hit_rate, readmission,
            str(pre["preemptions"]), f"{pre['recompute_share_pct']:.1f}%"]


def table(result: dict) -> pd.DataFrame:
    caching = result["settings"].enable_prefix_caching
    data = {"paged": column(result["paged"][1], True, caching)}
    for policy, (_, summary) in result["policies"].items():
        data[POLICY_LABELS[policy]] = column(summary, False, caching)
    return pd.DataFrame(data, index=ROWS)


def show(result: dict) -> None:
    name, settings = result["name"], result["settings"]
    p_rec, p = result["paged"]
    st.subheader(f"{name}: accounting at each request's final length")
    pool = p_rec[0].snapshot
    st.caption(f"{pool.num_blocks} blocks of {pool.block_size} = {pool.num_blocks * pool.block_size:,} token slots "
               f"on both sides; "
               f"prefix caching {'on' if settings.enable_prefix_caching else 'off'}, preemption by "
               f"{settings.preemption_mode}, seed {result['seed']}.")
    st.table(table(result))
    st.caption("Policies (the vLLM paper's baselines, Kwon et al., SOSP 2023, section 6): "
               + "; ".join(f"**{POLICY_LABELS[p]}** reserves {POLICY_RESERVES[p]}"
                           + (f" (R = {settings.reservation:,} slots)" if p == "max" else "")
                           for p in CONTIGUOUS_POLICIES)
               + ". Pow2 and Oracle learn each request's final length from the paged run. Paged internal "
                 "fragmentation is the unfilled tail of last blocks (a block shared by samples or found in the "
                 "prefix cache counts once); it has no external fragmentation (any free block serves any request). "
                 "Slots used count each stored token: a contiguous reservation stores a shared prefix again for "
                 "every request, paging once. "
                 "Contiguous external fragmentation is measured against the reservation of the request waiting at "
                 "the door. Engine steps, not tokens/s, compare the allocators' throughput here: on this CPU the "
                 "wall clock mostly measures the reference attention code (the CLI reports it). The hit rate counts "
                 "first admissions only; re-admissions after a preemption (which mostly find their own freed "
                 "blocks) are counted apart.")
    for policy, reason in result["skipped"].items():
        st.warning(f"{POLICY_LABELS[policy]} could not run this workload: {reason}")
    if not result["policies"]:
        return
    ran = list(result["policies"])
    policy = st.selectbox("Contiguous policy to draw", ran, format_func=POLICY_LABELS.get, key="compare_policy")
    c_rec, _ = result["policies"][policy]
    order = sorted({s.request_id for r in p_rec for s in r.snapshot.sequences},
                   key=lambda x: int(x[1:]) if x[1:].isdigit() else 0)
    peak = max(range(len(p_rec)), key=lambda i: metrics.slots_allocated(p_rec[i].snapshot))
    step = st.slider("Show memory at step", 1, max(len(p_rec), len(c_rec)), peak + 1) - 1
    left, right = st.columns(2)
    left.plotly_chart(paged_slots_figure(p_rec[min(step, len(p_rec) - 1)].snapshot, order), width="stretch")
    right.plotly_chart(contiguous_region_figure(c_rec[min(step, len(c_rec) - 1)].snapshot.contiguous, order),
                       width="stretch")
    st.plotly_chart(timeline_figure({"paged": p_rec, POLICY_LABELS[policy]: c_rec}, current_step=step + 1),
                    width="stretch")


def main() -> None:
    st.title("Compare: paged vs contiguous")
    st.write("The same requests, the same model and the same bytes of KV memory, run to completion. The "
             "contiguous baseline reserves a range per request at admission, under each of four policies; the "
             "paged engine takes blocks as tokens arrive.")
    compare = [n for n, s in SCENARIOS.items() if s.compare] + [n for n, s in SCENARIOS.items() if not s.compare]
    name = st.selectbox("Workload", compare, index=0,
                        format_func=lambda n: n if SCENARIOS[n].compare else f"{n} (a Playground preset)")
    st.caption(SCENARIOS[name].description)
    seed = int(st.number_input("Seed", value=0, min_value=0, step=1))
    if st.button("Run all", type="primary"):
        st.session_state.pop("compare", None)
        try:
            tokenizer = shared_model(preset_settings(name).model)[1]
            workload = SCENARIOS[name].make(seed, _tokenize(tokenizer))
            refusal = single_sequence_refusal(workload)
            if refusal:
                st.session_state["compare_error"] = f"{name} cannot run on the contiguous baseline: {refusal}"
            else:
                st.session_state["compare"] = run_all(name, seed)
        except ValueError as exc:
            st.session_state["compare_error"] = f"{name} cannot run here: {exc}"
    if err := st.session_state.pop("compare_error", None):
        st.error(err)
    if "compare" in st.session_state:
        show(st.session_state["compare"])


main()

"""Compare: one workload run to completion on the paged engine and on the contiguous baseline, in the
same KV byte budget; their accounting side by side."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from engine import LLMEngine
from engine.cli import contiguous_summary, paged_summary
from engine.scenarios import SCENARIOS
from engine.workloads import run_workload
from ui.lab import LabSettings
from ui.state import default_settings, shared_model
from viz import contiguous_region_figure, paged_slots_figure, timeline_figure

st.title("Compare: paged vs contiguous")
st.write("The same requests, the same model and the same bytes of KV memory. The contiguous baseline "
         "reserves a fixed range per request at admission; the paged engine takes blocks as tokens arrive.")
# workloads both allocators can run (the contiguous baseline serves one sequence per request)
single = {"parallel-sampling", "beam-search"}
compare = [n for n, s in SCENARIOS.items() if s.compare] + [n for n, s in SCENARIOS.items()
                                                            if not s.compare and n not in single]
name = st.selectbox("Workload", compare, index=0)
seed = st.number_input("Seed", value=0, min_value=0, step=1)
if st.button("Run both", type="primary"):
    scenario = SCENARIOS[name]
    d = scenario.engine_defaults
    base = default_settings()
    settings = LabSettings(model=base.model, preset=name, block_size=d.get("block_size", 16),
                           num_blocks=d.get("num_blocks", 64), max_model_len=d.get("max_model_len", 256),
                           reservation=d.get("reservation_tokens"), seed=int(seed),
                           preemption_mode=d.get("preemption_mode", "recompute"),
                           swap_space_blocks=d.get("swap_space_blocks"))
    results = {}
    try:
        with st.spinner("Running the workload on both engines..."):
            for alloc in ("paged", "contiguous"):
                engine = LLMEngine(settings.config(alloc), shared_model(settings.model))
                tokenize = lambda t, e=engine: e.tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
                records = []
                outputs = run_workload(engine, scenario.make(int(seed), tokenize), on_step=records.append)
                summary = (paged_summary if alloc == "paged" else contiguous_summary)(engine, records, outputs)
                results[alloc] = (records, summary)
    except ValueError as exc:
        st.session_state.pop("compare", None)
        st.error(f"This workload cannot run on both allocators: {exc}")
    else:
        st.session_state["compare"] = (name, results)

if "compare" in st.session_state:
    name, results = st.session_state["compare"]
    (p_rec, p), (c_rec, c) = results["paged"], results["contiguous"]
    st.subheader(f"{name}: accounting at each request's final length")
    table = pd.DataFrame({
        "paged": [f"{p['slots_allocated']:,}", f"{p['slots_used']:,}", f"{p['waste_pct']:.1f}%",
                  str(p["peak_concurrency"]), f"{p['kv_utilization']:.1f}%", str(p["queued_at_door"]),
                  str(p["steps"]), f"{p['tokens_per_s']:.0f}"],
        "contiguous": [f"{c['reserved_slots']:,}", f"{c['used_slots']:,}", f"{c['waste_pct']:.1f}%",
                       str(c["peak_concurrency"]), f"{c['kv_utilization']:.1f}%", str(c["queued_at_door"]),
                       str(c["steps"]), f"{c['tokens_per_s']:.0f}"],
    }, index=["slots allocated / reserved", "slots used", "waste", "peak concurrency", "KV utilisation (mean)",
              "requests that waited at the door", "engine steps", "tokens/s"])
    st.table(table)
    st.caption(f"Contiguous internal fragmentation {c['internal_frag_slots']:,} slots; external fragmentation up to "
               f"{c['external_frag_slots']:,} slots.")
    order = sorted({s.request_id for r in p_rec for s in r.snapshot.sequences}, key=lambda x: int(x[1:]) if x[1:].isdigit() else 0)
    peak = max(range(len(p_rec)), key=lambda i: p_rec[i].snapshot.slots_allocated)
    step = st.slider("Show memory at step", 1, len(p_rec), peak + 1) - 1
    left, right = st.columns(2)
    left.plotly_chart(paged_slots_figure(p_rec[step].snapshot, order), width="stretch")
    right.plotly_chart(contiguous_region_figure(c_rec[min(step, len(c_rec) - 1)].snapshot.contiguous, order),
                       width="stretch")
    st.plotly_chart(timeline_figure({"paged": p_rec, "contiguous": c_rec}), width="stretch")

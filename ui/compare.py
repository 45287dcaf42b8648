"""Compare: one workload run to completion on the paged engine and on the contiguous baseline under each of
its four reservation policies, in the same KV byte budget; their accounting side by side.

Settings come from the Playground's one path (``ui.state.preset_settings``: a ``RunSpec``, whose
``engine_config`` builds every engine), so a scenario's own engine settings (its pool, reservation, preemption
mode, prefix caching) hold here too. The runs are ``engine.scenarios.run_spec.run_paged_then_contiguous``: the
paged run goes first, and the final lengths the baselines' scheduler reaches are what "pow2" and "oracle"
must know in advance. Every number in the table is ``engine.cli``'s summary, built from ``engine.metrics``.

The paged engine runs the semantics chosen on the page (the paper's, vLLM V0, or vLLM V1 with its token
budget); the contiguous baselines always run the paper's scheduler. In V1, "pow2" and "oracle" learn the
final lengths from a paged run in the paper's semantics, the scheduler the baselines run (sampled tokens
could differ under another batching), when the workload's lengths are not known in advance.

The contiguous runs do not run the model: each sequence samples the tokens it sampled on the paged engine
under the baselines' scheduler (``engine.replay_runner``: the scheduler, allocator and records are a real
run's; ``tests/test_replay_runner.py`` compares them record by record). In V1 that is the headless paper run,
which therefore runs whenever the workload can be replayed. A workload with a beam search runs its baselines on
the model (its beams depend on log-probabilities no run records); the timing line says which.

A finished comparison is kept once per server process under everything that decides it (``run_key``) and
shared by every session (``cached_run_all``, ``infra.runs.COMPARE_RUNS``): the runs are deterministic. While
they run, a progress box says which run and how far (``infra.runs.ProgressBox``).
"""

from __future__ import annotations

import dataclasses
import time

import pandas as pd
import streamlit as st

from engine import metrics
from engine.cli import contiguous_summary, paged_summary
from engine.model_loader import load_shared
from engine.config import CONTIGUOUS_POLICIES, DEFAULT_MAX_NUM_BATCHED_TOKENS_V1, SEMANTICS
from engine.scenarios.presets import SCENARIOS
from engine.replay_runner import replayable
from engine.scenarios.run_spec import lengths_known, run_paged_then_contiguous
from infra.runs import COMPARE_RUNS, ProgressBox, preload_model, token_detail
from infra import class_limits as limits
from engine.scenarios.run_spec import max_num_seqs_for
from ui.lab import (POLICY_LABELS, POLICY_RESERVES, SEMANTICS_LABELS, engine_semantics_line,
                    fit_semantics, semantics_line)
from ui.state import preset_settings
from viz import contiguous_region_figure, paged_slots_figure, timeline_figure
from viz.steps import step_tokens_figure

ROWS = ["slots allocated / reserved", "slots used", "waste", "internal fragmentation (slots)",
        "external fragmentation (max, slots)", "peak concurrency", "KV utilisation (mean)",
        "requests that waited at the door", "engine steps",
        "prefix-cache hit rate (first admissions)", "re-admission hit tokens", "preemptions",
        "recompute share of prefill"]


def _tokenize(tokenizer):
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


def paged_column(semantics: str) -> str:
    """The paged engine's column in the table: "paged", or "paged (vLLM V1)"."""
    return "paged" if semantics == "paper" else f"paged ({SEMANTICS_LABELS[semantics]})"


def settings_for(name: str, seed: int, semantics: str = "paper", budget: int | None = None):
    """(settings in effect, note): the preset's Playground settings for ``semantics`` and V1 ``budget``, fitted
    to the semantics (a workload V1 cannot run runs in the paper's; the note says why). Raises ValueError."""
    return fit_semantics(preset_settings(name, seed=seed, semantics=semantics, max_num_batched_tokens=budget))


def run_key(name: str, seed: int, semantics: str = "paper", budget: int | None = None) -> tuple:
    """Everything that decides ``run_all``'s result (the runs are deterministic: the same key, the same
    records): the workload, seed, the requested semantics and budget, and every fitted setting."""
    settings, _ = settings_for(name, seed, semantics, budget)
    return ("compare", name, seed, semantics, budget, dataclasses.astuple(settings))


class _Runs:
    """Progress over the runs of one comparison: ``report(what, fraction, detail)`` after every step, the
    fraction over all runs (each counts alike; within a run, tokens generated of the most it can generate)."""

    def __init__(self, report, count: int, total_tokens: int, known: bool) -> None:
        self.report, self.count, self.total, self.known = report, count, total_tokens, known
        self.done = 0

    def on_step(self, what: str, records: list):
        state = {"tokens": 0}

        def on_step(record) -> None:
            records.append(record)
            if self.report is None:
                return
            state["tokens"] += len(record.new_tokens)
            within = state["tokens"] / self.total if self.total else 0.0
            self.report(f"{what} (run {self.done + 1} of {self.count})", (self.done + min(within, 1.0)) / self.count,
                        token_detail(len(records), state["tokens"], self.total, self.known))
        return on_step


def run_all(name: str, seed: int, semantics: str = "paper", budget: int | None = None, report=None) -> dict:
    """Run ``name`` on the paged engine in ``semantics`` ("paper" | "v1"; ``budget``: V1's token budget per
    step), then on the contiguous baseline under every policy (the paper's scheduler):
    ``engine.scenarios.run_spec.run_paged_then_contiguous``. ``report(what, fraction, detail)``, if given, is
    called after every engine step (``infra.runs.RunCache.get``'s).

    Returns {"name", "seed", "settings", "semantics", "semantics_line", "semantics_note", "budget", "paged":
    (records, summary), "policies": {policy: (records, summary)}, "skipped": {policy: reason}, "seconds":
    {"paged", "learn", "contiguous": {policy: s}, "total"}, "tokens": {policy: "replayed" | "model"},
    "not_replayed": why none was replayed, or None}; the settings are those in effect (a workload V1
    cannot run runs in the paper's semantics, "semantics_note" says why). The result may be shared by every
    session (``cached_run_all``): read it, never change it.
    Raises ValueError (settings, a class server's caps, or the paged engine refusing a request); a policy
    that cannot run is listed in "skipped" with the engine's reason.
    """
    start = time.perf_counter()
    settings, note = settings_for(name, seed, semantics, budget)
    limits.check_spec(settings)  # a class server's caps and models, before anything is loaded or allocated
    loaded = load_shared(settings.model)  # no drawing: this may run in a worker thread (the page loaded it)
    workload = SCENARIOS[name].make(seed, _tokenize(loaded[1]))
    limits.check_request_count(0, sum(r.params.n if settings.semantics == "v1" else 1 for r in workload.requests))
    n = len(workload.requests)
    # V1: a headless paper run learns the final lengths and gives the tokens the baselines replay
    learn = settings.semantics != "paper" and (not lengths_known(workload) or replayable(workload))
    progress = _Runs(report, 1 + learn + len(CONTIGUOUS_POLICIES),
                     sum(r.params.max_tokens * r.params.num_seqs for r in workload.requests),
                     all(r.params.length_known for r in workload.requests))
    label = {"paged": f"Running {n} request{'s' * (n != 1)} of {name} on the paged engine "
                      f"({SEMANTICS_LABELS[settings.semantics]})",
             "learn": "Running the requests under the baselines' scheduler (the paper's): the final lengths "
                      "it reaches and the tokens the baselines replay"}
    label.update({p: f"Running the same requests on the contiguous baseline, {POLICY_LABELS[p]}: it reserves "
                     f"{POLICY_RESERVES[p]}" for p in CONTIGUOUS_POLICIES})

    def on_step(what: str):
        progress.done = (0 if what == "paged" else 1 if what == "learn"
                         else 1 + learn + CONTIGUOUS_POLICIES.index(what))
        return progress.on_step(label[what], [])

    runs = run_paged_then_contiguous(settings, workload, loaded, CONTIGUOUS_POLICIES, on_step=on_step,
                                     skip_refused=True)
    paged = runs.paged.engine
    result = {"name": name, "seed": seed, "settings": settings, "semantics": paged.semantics,
              "semantics_line": engine_semantics_line(paged), "semantics_note": note,
              "budget": paged.max_num_batched_tokens if paged.semantics == "v1" else None,
              "paged": (runs.paged.records, paged_summary(paged, runs.paged.records, runs.paged.outputs)),
              "policies": {p: (r.records, contiguous_summary(r.engine, r.records, r.outputs))
                           for p, r in runs.contiguous.items()},
              "skipped": runs.skipped, "seconds": {**runs.seconds, "total": time.perf_counter() - start},
              "tokens": runs.tokens, "not_replayed": runs.not_replayed}
    return result


def cached_run_all(name: str, seed: int, semantics: str = "paper", budget: int | None = None,
                   on_progress=None) -> dict:
    """``run_all``, computed once per process for these settings (``run_key``) and shared by every session
    (``infra.runs.COMPARE_RUNS``); ``on_progress`` follows it while it runs. Raises as ``run_all``."""
    return COMPARE_RUNS.get(run_key(name, seed, semantics, budget),
                            lambda report: run_all(name, seed, semantics, budget, report), on_progress=on_progress)


def timing_line(result: dict, cached: bool) -> str:
    """How long the runs took, and whether this page computed them or found them kept."""
    sec = result.get("seconds")
    if not sec:
        return ""
    contiguous = sum(sec["contiguous"].values())
    steps = len(result["paged"][0]) + sum(len(r) for r, _ in result["policies"].values())
    how = result.get("tokens", {})
    replayed = sum(v == "replayed" for v in how.values())
    source = "that run's" if sec["learn"] else "the paged run's"  # V1: the run under the paper's scheduler
    tokens = (f"replaying {source} tokens" if how and replayed == len(how)
              else f"{replayed} of {len(how)} replaying {source} tokens" if replayed
              else "on the model" + (f": {result['not_replayed']}" if result.get("not_replayed") else ""))
    line = (f"{1 + len(result['policies'])} runs, {steps:,} engine steps in {sec['total']:.1f} s (paged "
            f"{sec['paged']:.1f} s, " + (f"the paper's scheduler for the baselines {sec['learn']:.1f} s, "
                                         if sec["learn"] else "")
            + f"contiguous {contiguous:.1f} s, {tokens})")
    return (f"Kept from an earlier run with the same settings on this server: {line}." if cached
            else f"Ran now: {line}; kept for anyone running the same settings.")


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
    data = {paged_column(result.get("semantics", "paper")): column(result["paged"][1], True, caching)}
    for policy, (_, summary) in result["policies"].items():
        data[POLICY_LABELS[policy]] = column(summary, False, caching)
    return pd.DataFrame(data, index=ROWS)


def show(result: dict) -> None:
    name, settings = result["name"], result["settings"]
    p_rec, p = result["paged"]
    st.subheader(f"{name}: accounting at each request's final length")
    if result.get("semantics_note"):
        st.warning(result["semantics_note"], icon=":material/info:")
    pool = p_rec[0].snapshot
    line = result["semantics_line"]
    st.caption(f"Paged column, {line[0].lower() + line[1:]}. Contiguous columns: the paper's scheduler. "
               f"{pool.num_blocks} blocks of {pool.block_size} = {pool.num_blocks * pool.block_size:,} token slots "
               f"on both sides; "
               f"prefix caching {'on' if settings.enable_prefix_caching else 'off'}, preemption by "
               f"{settings.preemption_mode}, seed {result['seed']}.")
    st.table(table(result))
    if line := timing_line(result, st.session_state.get("compare_cached", False)):
        st.caption(line)
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
    st.plotly_chart(step_tokens_figure(p_rec, budget=result.get("budget"), current_step=step + 1,
                                       semantics=result.get("semantics")), width="stretch")


def _forget_result() -> None:
    """Another semantics or budget: the table on screen would no longer be what the switch says."""
    st.session_state.pop("compare", None)


def semantics_choice() -> tuple[str, int | None]:
    """The paged engine's semantics and, in V1, its token budget per step (the Playground's switch)."""
    c1, c2 = st.columns([2, 1])
    semantics = c1.radio("Semantics of the paged engine", SEMANTICS, format_func=SEMANTICS_LABELS.get,
                         horizontal=True, key="compare_semantics", on_change=_forget_result,
                         help="Paper (vLLM V0): prefill or decode steps, fork + copy-on-write, recompute or swap. "
                              "vLLM V1: one token budget per step shared by decode tokens and prefill chunks, n as "
                              "child requests over the prefix cache, recompute-only preemption. The contiguous "
                              "baselines always run the paper's scheduler.")
    budget = None
    if semantics == "v1":
        # Streamlit forgets a widget's value while it is not drawn (in the paper's semantics): keep the budget
        # apart, so switching to the paper's semantics and back does not reset it to 2,048
        kept = st.session_state.get("compare_budget_kept", DEFAULT_MAX_NUM_BATCHED_TOKENS_V1)
        budget = int(c2.number_input("Token budget per step", value=kept, step=16,
                                     key="compare_budget", on_change=_forget_result,
                                     help="vLLM V1's max_num_batched_tokens: decode tokens and prefill chunks "
                                          "share it each step; longer prompts are prefilled in chunks."))
        st.session_state["compare_budget_kept"] = budget
    return semantics, budget


def main() -> None:
    st.title("Compare: paged vs contiguous")
    top = st.empty()  # the semantics line, filled once the switch below is read
    st.write("The same requests, the same model and the same bytes of KV memory, run to completion. The "
             "contiguous baseline reserves a range per request at admission, under each of four policies; the "
             "paged engine takes blocks as tokens arrive.")
    semantics, budget = semantics_choice()
    compare = [n for n, s in SCENARIOS.items() if s.compare] + [n for n, s in SCENARIOS.items() if not s.compare]
    name = st.selectbox("Workload", compare, index=0,
                        format_func=lambda n: n if SCENARIOS[n].compare else f"{n} (a Playground preset)")
    st.caption(SCENARIOS[name].description)
    seed = int(st.number_input("Seed", value=0, min_value=0, step=1))
    model = preset_settings(name).model
    preload_model(model)  # in the background while the learner picks: "Run all" then finds it loaded
    if st.button("Run all", type="primary"):
        st.session_state.pop("compare", None)
        try:
            cached = run_key(name, seed, semantics, budget) in COMPARE_RUNS
            with ProgressBox(f"Running {name} on the paged engine, then on the contiguous baseline under "
                             f"each of its {len(CONTIGUOUS_POLICIES)} policies") as box:
                st.session_state["compare"] = cached_run_all(name, seed, semantics, budget, on_progress=box)
            st.session_state["compare_cached"] = cached
        except ValueError as exc:
            st.session_state["compare_error"] = f"{name} cannot run here: {exc}"
    if err := st.session_state.pop("compare_error", None):
        st.error(err)
    result = st.session_state.get("compare")
    line = result["semantics_line"] if result else semantics_line(
        semantics, budget, max_num_seqs=max_num_seqs_for(semantics, budget))
    top.markdown(f"**{line}** (the paged engine; the contiguous baselines run the paper's scheduler).")
    if result:
        show(result)


if __name__ == "__main__":  # Streamlit runs the page as __main__; tests import run_all
    main()

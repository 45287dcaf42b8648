"""Lesson 5: when memory runs out. Three runs of the same five requests on the embedded model: a tight
pool with preemption by recompute, the same with swap, and a roomy pool as the reference."""

from __future__ import annotations

from lessons.common import scenario_requests, scenario_run
from lessons.exercise import Exercise

SCENARIO = "memory-pressure"  # engine/scenarios.py; the Playground button loads the same preset
ROOMY_BLOCKS = 64  # a pool big enough that nobody is preempted: the reference for the outputs
POLICIES = {"recompute (tight pool)": "recompute", "swap (tight pool)": "swap", "roomy pool (no pressure)": "roomy"}


def requests(tokenizer) -> list:
    """The scenario's (prompt token ids, params) pairs."""
    return scenario_requests((None, tokenizer), SCENARIO)


def pressure_run(loaded, policy: str):
    """policy: "recompute", "swap" (the scenario's tight pool) or "roomy" (a pool big enough for everything)."""
    if policy == "roomy":
        return scenario_run(loaded, SCENARIO, num_blocks=ROOMY_BLOCKS)
    return scenario_run(loaded, SCENARIO, preemption_mode=policy)


def late_preemption(run) -> dict | None:
    """The last preemption of a run whose step also frees finished requests' blocks (too late for the
    victim), with the step where the victim is prefilled again. None if there is none."""
    for i in range(len(run.records) - 1, -1, -1):
        events = run.records[i].events
        preempts = [e for e in events if e.kind == "preempt"]
        finished = [e.request_id for e in events if e.kind == "finish"]
        if preempts and finished:
            victim = preempts[-1].request_id
            back = next((rec.step for rec in run.records[i + 1:] for e in rec.events
                         if e.kind == "allocate" and e.request_id == victim), None)
            freed = sum(len(e.blocks) for e in events if e.kind == "free" and e.request_id in finished)
            return {"step": run.records[i].step, "victim": victim, "needy": preempts[-1].data["reason"].split()[0],
                    "finished": " and ".join(finished), "freed": freed, "back": back}
    return None


def facts(ctx) -> dict:
    run = ctx.run(pressure_run, "recompute")
    ids = run.request_ids
    late = late_preemption(run)
    note = ""
    if late:
        note = (f"Look at step {late['step']} of the recompute run: {late['victim']} is preempted so that "
                f"{late['needy']} gets a block, and in the same step {late['finished']} finish and free "
                f"{late['freed']} blocks, too late for {late['victim']}, whose tokens are computed again at step "
                f"{late['back']}. The scheduler decides one step at a time; it does not know which requests are "
                "about to finish.")
    prompts = [len(p) for p, _ in requests(ctx.loaded[1])]
    params = [sp for _, sp in requests(ctx.loaded[1])]
    return {"late_note": note, "num_blocks": run.num_blocks, "block_size": run.block_size,
            "small_ids": ", ".join(ids[:-1]), "small_prompt": prompts[0], "small_tokens": params[0].max_tokens,
            "big_id": ids[-1], "big_prompt": prompts[-1], "big_tokens": params[-1].max_tokens}


def exercises(ctx) -> dict[str, Exercise]:
    rec_run, swap_run, roomy = (ctx.run(pressure_run, p) for p in ("recompute", "swap", "roomy"))
    ids = rec_run.request_ids
    first = rec_run.records[0]
    admitted = [e.request_id for e in first.events if e.kind == "admit"]
    waits = [e for e in first.events if e.kind == "wait"] or [e for e in rec_run.records[1].events if e.kind == "wait"]
    i, preempt = rec_run.first("preempt")
    victim = preempt.request_id
    readmit = next(e for rec in rec_run.records[i + 1:] for e in rec.events
                   if e.kind == "allocate" and e.request_id == victim)
    _, swap_out = swap_run.first("swap_out")
    held = next(seq.num_tokens for seq in rec_run.records[i - 1].snapshot.sequences if seq.seq_id == victim)
    same = all(rec_run.outputs[r].output_token_ids == roomy.outputs[r].output_token_ids ==
               swap_run.outputs[r].output_token_ids for r in ids)
    same_options = ["yes, token for token", "no: recomputing gives slightly different numbers",
                    "only with swap; recompute changes it"]
    B = rec_run.block_size
    small_prompt = len(requests(ctx.loaded[1])[0][0])
    return {
        "m_admit": Exercise("m_admit", f"How many of the {len(ids)} requests does the first step admit?", "number",
                            len(admitted), unit="requests",
                            explanation=(f"{', '.join(admitted)} take {first.snapshot.num_used_blocks} blocks; "
                                         + (f"the engine said: *{waits[0].message}*." if waits else ""))),
        "m_step": Exercise("m_step", f"The running requests each hold {small_prompt} prompt tokens "
                           f"and write one token per step from step 2 on (step 1 is the prefill, which also "
                           f"produces the first new token). At which **step** does the pool run out, so that "
                           f"someone is preempted?", "number", rec_run.records[i].step,
                           explanation=(f"Step {rec_run.records[i].step} writes token "
                                        f"{rec_run.first('new_block')[1].data['position']}, the first of a new block "
                                        f"of {B}, for every running request at once: "
                                        f"{len(rec_run.records[i - 1].snapshot.running)} requests need a block each and {rec_run.records[i - 1].snapshot.num_free_blocks} are "
                                        "free. Somebody has to give up theirs.")),
        "m_victim": Exercise("m_victim", "Which request is preempted?", "choice", victim, options=list(ids[:-1]),
                             explanation=(f"{victim}: of the running requests it was admitted last, so the others, "
                                          "which have waited longer, keep going (first come, first served). Its "
                                          "blocks are freed and handed to the requests that needed one.")),
        "m_recompute": Exercise("m_recompute", "With **recompute**, the preempted request is prefilled again when "
                                "it is admitted again. How many tokens does that prefill compute? (Count every "
                                "token it has: its prompt, and every token it has generated so far.)", "number", readmit.data["num_tokens"], unit="tokens",
                                explanation=(f"{held} tokens had their keys and values in its blocks, plus the last "
                                             "token it sampled, which had not been written yet (the next decode step "
                                             f"would have done that): {readmit.data['num_tokens']}. The engine said, "
                                             f"when {victim} came back: *{readmit.message}*.")),
        "m_swap": Exercise("m_swap", "With **swap** instead, how many blocks does the preempted request copy to "
                           "the CPU?",
                           "number", len(swap_out.blocks), unit="blocks",
                           explanation=f"The engine said: *{swap_out.message}*"),
        "m_same": Exercise("m_same", "Is the preempted request's reply (greedy decoding) the same as in a run with a "
                           "roomy pool where nobody is preempted?", "choice", same_options[0] if same else same_options[1],
                           options=same_options,
                           explanation=("The engine compared all three runs: " + ("every request's tokens are "
                                        "identical" if same else "they differ") + ". Preemption changes when a "
                                        "request runs, not what it computes: its keys and values are recomputed from "
                                        "the same tokens, or copied back bit for bit.")),
    }


def widget_runs(ctx) -> None:
    import streamlit as st

    from lessons.widgets import step_through
    from viz import timeline_figure

    tokenizer = ctx.loaded[1]
    with st.container(border=True):
        label = st.radio("Policy", list(POLICIES), horizontal=True, key="keep_l5_policy")
        run = ctx.run(pressure_run, POLICIES[label])
        step_through(run, f"l5_step_{POLICIES[label]}", lambda ids: tokenizer.decode(ids),
                     jump_kinds=("admit", "preempt", "swap_out", "swap_in", "free"))
        current = st.session_state.get(f"l5_step_{POLICIES[label]}:kept", 1)
        st.plotly_chart(timeline_figure({label: run.records}, current_step=current), width="stretch",
                        key=f"l5_tl_{POLICIES[label]}", config={"displayModeBar": False})


if __name__ == "__main__":
    from lessons.render import render_lesson

    render_lesson(__file__)

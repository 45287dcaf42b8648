"""Lesson 5: when memory runs out. Three runs of the same five requests on the embedded model: a tight
pool with preemption by recompute, the same with swap, and a roomy pool as the reference."""

from __future__ import annotations

from engine import SamplingParams
from lessons.common import prompt_of_length, run_engine
from lessons.exercise import Exercise

TEXTS = ["ROMEO. But soft, what light through yonder window breaks? ",
         "HAMLET. To be, or not to be, that is the question: ",
         "KING LEAR. Where is my fool? Ho, I think the world's asleep. ",
         "MACBETH. Is this a dagger which I see before me? "]
BIG_TEXT = "JULIET. O Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name. "
SETUP = {"small_prompt": 20, "small_tokens": 30, "big_prompt": 100, "big_tokens": 10, "block_size": 16,
         "num_blocks": 10, "roomy_blocks": 64, "swap_blocks": 16, "max_model_len": 128}
POLICIES = {"recompute (tight pool)": "recompute", "swap (tight pool)": "swap", "roomy pool (no pressure)": "roomy"}


def requests(tokenizer) -> list:
    s = SETUP
    out = [(prompt_of_length(tokenizer, s["small_prompt"], t),
            SamplingParams(max_tokens=s["small_tokens"], temperature=0.0, ignore_eos=True)) for t in TEXTS]
    out.append((prompt_of_length(tokenizer, s["big_prompt"], BIG_TEXT),
                SamplingParams(max_tokens=s["big_tokens"], temperature=0.0, ignore_eos=True)))
    return out


def pressure_run(loaded, policy: str):
    """policy: "recompute", "swap" (tight pool) or "roomy" (a pool big enough for everything)."""
    s = SETUP
    return run_engine(loaded, requests(loaded[1]), block_size=s["block_size"], max_model_len=s["max_model_len"],
                      num_blocks=s["roomy_blocks"] if policy == "roomy" else s["num_blocks"],
                      preemption_mode="swap" if policy == "swap" else "recompute",
                      swap_space_blocks=s["swap_blocks"], enable_prefix_caching=False)


def facts(ctx) -> dict:
    run = ctx.run(pressure_run, "recompute")
    ids = run.request_ids
    return {"num_blocks": SETUP["num_blocks"], "block_size": SETUP["block_size"],
            "small_ids": ", ".join(ids[:-1]), "small_prompt": SETUP["small_prompt"],
            "small_tokens": SETUP["small_tokens"], "big_id": ids[-1], "big_prompt": SETUP["big_prompt"]}


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
    same = all(rec_run.outputs[r].output_token_ids == roomy.outputs[r].output_token_ids ==
               swap_run.outputs[r].output_token_ids for r in ids)
    same_options = ["yes, token for token", "no: recomputing gives slightly different numbers",
                    "only with swap; recompute changes it"]
    B = SETUP["block_size"]
    return {
        "m_admit": Exercise("m_admit", f"How many of the {len(ids)} requests does the first step admit?", "number",
                            len(admitted), unit="requests",
                            explanation=(f"{', '.join(admitted)} take {first.snapshot.num_used_blocks} blocks; "
                                         + (f"the engine said: *{waits[0].message}*." if waits else ""))),
        "m_step": Exercise("m_step", f"The running requests each hold {SETUP['small_prompt']} prompt tokens "
                           f"and write one token per step from step 2 on (step 1 is the prefill, which also "
                           f"produces the first new token). At which **step** does the pool run out, so that "
                           f"someone is preempted?", "number", rec_run.records[i].step,
                           explanation=(f"Step {rec_run.records[i].step} writes token "
                                        f"{rec_run.first('new_block')[1].data['position']}, the first of a new block "
                                        f"of {B}, for every running request at once. The engine said: "
                                        f"*{preempt.message}*")),
        "m_victim": Exercise("m_victim", "Which request is preempted?", "choice", victim, options=list(ids[:-1]),
                             explanation=(f"{victim}: of the running requests it was admitted last, so the others, "
                                          "which have waited longer, keep going (first come, first served).")),
        "m_recompute": Exercise("m_recompute", "With **recompute**, how many tokens does the engine compute again when "
                                "the preempted request is admitted again?", "number", readmit.data["num_tokens"], unit="tokens",
                                explanation=(f"{victim}'s prompt and every token it had generated: the engine said "
                                             f"*{readmit.message}*.")),
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
        label = st.radio("Policy", list(POLICIES), horizontal=True, key="l5_policy")
        run = ctx.run(pressure_run, POLICIES[label])
        step_through(run, f"l5_step_{POLICIES[label]}", lambda ids: tokenizer.decode(ids),
                     jump_kinds=("admit", "preempt", "swap_out", "swap_in", "free"))
        st.plotly_chart(timeline_figure({label: run.records}), width="stretch", key=f"l5_tl_{POLICIES[label]}")


if __name__ == "__main__":
    from lessons.render import render_lesson

    render_lesson(__file__)

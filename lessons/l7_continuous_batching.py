"""Lesson 7: continuous batching and chunked prefill, vLLM V1's scheduler.

One small workload, run on the embedded model in both semantics: three short requests (R1-R3) decode
while two longer prompts arrive later (R4, then R5). In vLLM V1 (``semantics="v1"``) every step hands out
one token budget (``max_num_batched_tokens``): running requests first (a decode token each, or the next
chunk of an unfinished prompt), then waiting requests with what is left, so a long prompt is prefilled in
chunks alongside everybody's decode tokens (mixed steps). The paper's scheduler (vLLM V0) runs a prompt in
a prefill step of its own. Every number the page shows is read from these runs' ``StepRecord``s
(``scheduled``: who computed how many tokens in each step; ``new_tokens`` and ``finished``).

Runs (each through ``ctx.run``, so the app computes it once per process): the paper's semantics, V1 with
the lesson's budget (``BUDGET``) and V1 with a smaller one (``SMALL_BUDGET``); the explore widget adds the
other ``WIDGET_BUDGETS`` when chosen. Figures are built here from plain records (no torch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine import SamplingParams
from engine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS_V1
from engine.scenarios.presets import exact_prompt
from lessons import batch_invariance
from lessons.common import EngineRun, run_engine
from lessons.exercise import Exercise, Slip

BUDGET = 32  # the lesson's V1 token budget per step (max_num_batched_tokens)
SMALL_BUDGET = 16  # the transfer questions' smaller budget
WIDGET_BUDGETS = (8, 16, 32, 64, 128)  # the explore widget's choices (each at least MAX_NUM_SEQS, as V1 requires)
MAX_NUM_SEQS = 8  # V1 refuses a budget below max_num_seqs (every running request gets a token each step)
ENGINE = dict(block_size=16, num_blocks=32, max_model_len=128, max_num_seqs=MAX_NUM_SEQS,
              enable_prefix_caching=False, watermark=0.0)  # a roomy pool: no request waits for memory here


@dataclass(frozen=True)
class Arrival:
    """One request of the lesson's workload: its prompt (text cut or repeated to ``prompt_len`` tokens), the
    tokens it writes (greedy, ``ignore_eos``: exactly ``max_tokens``) and the step before which it arrives."""

    text: str
    prompt_len: int
    max_tokens: int
    step: int


WORKLOAD = (
    Arrival("ROMEO. But soft, what light through yonder window breaks? ", 5, 10, 1),
    Arrival("HAMLET. To be, or not to be, that is the question: ", 5, 12, 1),
    Arrival("MACBETH. Is this a dagger which I see before me? ", 5, 14, 1),
    Arrival("JULIET. O Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name. ", 96, 8, 3),
    Arrival("KING LEAR. Where is my fool? Ho, I think the world's asleep. ", 48, 8, 6),
)
SHORT = 3  # R1-R3 are the short requests; R4 is the long prompt, R5 the second arrival
LONG, SECOND = 3, 4  # their indexes in WORKLOAD


def requests(tokenizer) -> list[tuple[list[int], SamplingParams, int]]:
    """(prompt token ids, params, arrival step) per request, in id order (R1..R5)."""
    tokenize = lambda t: tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    return [(exact_prompt(tokenize, a.text, a.prompt_len),
             SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True), a.step) for a in WORKLOAD]


def arrivals_run(loaded, semantics: str, budget: int | None = None) -> EngineRun:
    """The workload on a fresh engine: each request is added just before its arrival step, then the engine
    steps until all have finished. ``semantics``: "paper" or "v1"; ``budget``: V1's token budget per step.
    Raises ValueError for a bad budget (V1 needs at least ``MAX_NUM_SEQS``), RuntimeError if it does not end."""
    config = dict(ENGINE, semantics=semantics)
    if semantics == "v1":
        config["max_num_batched_tokens"] = budget
    pending = requests(loaded[1])
    label = "the paper's scheduler" if semantics == "paper" else f"vLLM V1, budget {budget}"
    return run_engine(loaded, [(prompt, params) for prompt, params, _ in pending], max_steps=500, label=label,
                      arrivals=[step for *_, step in pending], **config)


# ------------------------------------------------------------------------------- reading the records
def _rid(seq_id: str) -> str:
    return seq_id.split(".", 1)[0]


def tokens_per_step(run: EngineRun) -> list[dict[str, int]]:
    """Per step (index 0 = step 1): request id -> tokens it computed in that step (absent: none)."""
    out = []
    for rec in run.records:
        counts: dict[str, int] = {}
        for s in rec.scheduled:
            counts[s.request_id] = counts.get(s.request_id, 0) + s.num_tokens
        out.append(counts)
    return out


def step_row(run: EngineRun, step: int) -> list[int]:
    """Tokens each request (in id order) computed in ``step`` (1-based)."""
    counts = tokens_per_step(run)[step - 1]
    return [counts.get(r, 0) for r in run.request_ids]


def first_token_step(run: EngineRun, rid: str) -> int:
    """The step that sampled ``rid``'s first token (the one that computed its last prompt token)."""
    return next(rec.step for rec in run.records if any(_rid(s) == rid for s in rec.new_tokens))


def finish_step(run: EngineRun, rid: str) -> int:
    """The step that sampled ``rid``'s last token."""
    return next(rec.step for rec in run.records if any(_rid(s) == rid for s in rec.finished))


def steps_to_first_token(run: EngineRun, index: int) -> int:
    """Steps from request ``index``'s arrival to its first token, both counted (time to first token, in steps)."""
    return first_token_step(run, run.request_ids[index]) - WORKLOAD[index].step + 1


def stalled_steps(run: EngineRun, rid: str) -> list[int]:
    """Steps in which ``rid`` had already begun its reply and had not finished, yet computed no token."""
    first, last = first_token_step(run, rid), finish_step(run, rid)
    counts = tokens_per_step(run)
    return [s for s in range(first + 1, last + 1) if rid not in counts[s - 1]]


def prefill_steps(run: EngineRun, rid: str) -> list[int]:
    """Steps in which ``rid`` computed prompt tokens (its whole prompt, or a chunk of it)."""
    first = first_token_step(run, rid)
    return [rec.step for rec in run.records[:first] if any(s.request_id == rid for s in rec.scheduled)]


def largest_step(run: EngineRun) -> int:
    """The most tokens any one step computed."""
    return max(rec.num_tokens for rec in run.records)


def summary(run: EngineRun) -> dict:
    """The figures the lesson compares between runs."""
    ids = run.request_ids
    return {"r4_ttft": steps_to_first_token(run, LONG), "r5_ttft": steps_to_first_token(run, SECOND),
            "r1_last": finish_step(run, ids[0]), "largest": largest_step(run), "steps": len(run.records),
            "stalls": sorted({s for r in ids[:SHORT] for s in stalled_steps(run, r)})}


def _runs(ctx):
    return (ctx.run(arrivals_run, "paper", None), ctx.run(arrivals_run, "v1", BUDGET),
            ctx.run(arrivals_run, "v1", SMALL_BUDGET))


def playground() -> dict:
    """This lesson's Playground settings (its front matter's ``playground:`` line)."""
    from pathlib import Path

    from lessons import load_lesson

    return load_lesson(Path(__file__).with_suffix(".md")).playground


def _and(items: list[str]) -> str:
    """"16, 18 and 20"."""
    return ", ".join(items[:-1]) + f" and {items[-1]}" if len(items) > 1 else "".join(items)


def _steps(steps: list[int]) -> str:
    """"3 and 6", or "none"."""
    return _and([str(s) for s in steps]) if steps else "none"


# ------------------------------------------------------------------------------------------- the page
def facts(ctx) -> dict:
    paper, v1, small = _runs(ctx)
    tokenizer = ctx.loaded[1]
    reqs = requests(tokenizer)
    ids = v1.request_ids
    p, s32, s16 = summary(paper), summary(v1), summary(small)
    same = all(paper.outputs[r].output_token_ids == v1.outputs[r].output_token_ids == small.outputs[r].output_token_ids
               for r in ids)
    return {
        "budget": BUDGET, "small_budget": SMALL_BUDGET, "default_budget": DEFAULT_MAX_NUM_BATCHED_TOKENS_V1,
        "short_ids": ", ".join(ids[:SHORT]), "short_prompt": len(reqs[0][0]),
        "short_tokens": _and([str(sp.max_tokens) for _, sp, _ in reqs[:SHORT]]),
        "step1_tokens": v1.records[0].num_tokens, "step1_kind": v1.records[0].kind,
        "long_id": ids[LONG], "long_prompt": len(reqs[LONG][0]), "long_arrival": WORKLOAD[LONG].step,
        "second_id": ids[SECOND], "second_prompt": len(reqs[SECOND][0]), "second_arrival": WORKLOAD[SECOND].step,
        "max_num_seqs": MAX_NUM_SEQS,
        "playground_preset": playground()["preset"], "playground_budget": playground()["max_num_batched_tokens"],
        # revealed after the questions
        "paper_stalls": _steps(p["stalls"]), "paper_largest": p["largest"], "v1_largest": s32["largest"],
        "small_largest": s16["largest"], "v1_ttft": s32["r4_ttft"], "small_ttft": s16["r4_ttft"],
        "paper_ttft": p["r4_ttft"], "r1_last_paper": p["r1_last"], "r1_last_v1": s32["r1_last"],
        "mixed_steps": sum(r.kind == "mixed" for r in v1.records), "v1_steps": s32["steps"],
        "same_outputs": ("identical, token for token, in all three runs" if same
                         else "NOT identical across the runs (the engine should never do that)"),
        **batch_invariance.facts(),
    }


RECAP = [
    "vLLM V1 has no prefill or decode steps: each step shares one token budget (`max_num_batched_tokens`, "
    "{{ budget }} here), first among running requests (a decode token each, or a prompt's next chunk), then "
    "among waiting ones.",
    "A prompt longer than what is left of the budget is prefilled in chunks over several steps (chunked "
    "prefill); a step holding decode tokens and a chunk is a mixed step, and the step that computes the last "
    "prompt token samples the first output token.",
    "The paper's scheduler runs each new prompt in a prefill step of its own, so running requests got no "
    "token in steps {{ paper_stalls }} of the paper's run; in V1 they decoded in every step.",
    "The budget trades the long prompt's time to first token ({{ v1_ttft }} steps at {{ budget }}, "
    "{{ small_ttft }} at {{ small_budget }}) against the size of every step ({{ v1_largest }} vs "
    "{{ small_largest }} tokens at most), while decoding requests keep one token per step either way.",
    "In greedy decoding on this CPU float32 engine, scheduling changed when tokens were computed, not which: the "
    "replies were {{ same_outputs }}. vLLM on GPUs is not batch-invariant, and even here {{ bi_short }}.",
]


def exercises(ctx) -> dict[str, Exercise]:
    paper, v1, small = _runs(ctx)
    tokenizer = ctx.loaded[1]
    reqs = requests(tokenizer)
    ids = v1.request_ids
    r1, r4, r5 = ids[0], ids[LONG], ids[SECOND]
    long_len, second_len = len(reqs[LONG][0]), len(reqs[SECOND][0])
    a4, a5 = WORKLOAD[LONG].step, WORKLOAD[SECOND].step
    shorts = ", ".join(ids[:SHORT])

    # Q1: R4's first chunk, in the step it arrives
    chunk = tokens_per_step(v1)[a4 - 1][r4]
    decoders = sum(1 for r in ids[:SHORT] if r in tokens_per_step(v1)[a4 - 1])

    # Q2: steps from arrival to R4's first token (V1, budget BUDGET)
    ttft = steps_to_first_token(v1, LONG)

    # Q3: act as the scheduler in the step R5 arrives
    row = step_row(v1, a5)
    one_prefill = row[:SECOND] + [0]
    no_cap = row[:SECOND] + [second_len]
    paper_row = step_row(paper, a5)

    # Q4: the paper's pauses for R1
    p_stalls = stalled_steps(paper, r1)
    r4_only = [s for s in p_stalls if s in prefill_steps(paper, r4)]
    v1_prefill_steps = sorted(set(prefill_steps(v1, r4) + prefill_steps(v1, r5)))

    # Q5/Q6: a smaller budget
    ttft16 = steps_to_first_token(small, LONG)
    decoders16 = sum(1 for r in ids[:SHORT] if r in tokens_per_step(small)[a4 - 1])
    per_step16 = SMALL_BUDGET - decoders16
    last32, last16 = finish_step(v1, r1), finish_step(small, r1)
    when = ["at an earlier step", "at the same step", "at a later step"]
    r1_when = when[0] if last16 < last32 else when[1] if last16 == last32 else when[2]
    when_slips = {  # what choosing each option reveals, when it is not the engine's answer
        when[0]: ("earlier", f"Earlier would need fewer steps for {r1}'s tokens, but a decoding request writes one "
                             "token per step whatever the budget: a smaller budget cannot speed it up."),
        when[1]: ("same", f"The engine did not keep {r1}'s last token at the same step: look at which steps it "
                          "got no token in."),
        when[2]: ("later", f"Later would mean the smaller budget squeezed {r1}'s decode tokens out of some steps. "
                           "Running requests are served first, and their decode tokens fit in the smaller budget "
                           "too: only what comes after them gets less."),
    }

    return {
        "v_chunk": Exercise(
            "v_chunk", f"**vLLM V1, budget {BUDGET}.** {r4} ({long_len} prompt tokens) arrives just before step "
            f"{a4}, while {shorts} are decoding. How many of {r4}'s prompt tokens does step {a4} compute?",
            "number", chunk, unit="tokens",
            slips=[Slip("whole-budget", BUDGET,
                        f"That is the whole budget. Running requests are served first: {shorts} take their decode "
                        f"tokens out of the same {BUDGET} before a waiting request gets any."),
                   Slip("whole-prompt", long_len,
                        "That is the whole prompt, in one step: the paper's prefill. In V1 a step never computes "
                        "more than its budget, so a longer prompt is cut into chunks.")],
            explanation=(f"{decoders} running requests take a decode token each, and the rest of the budget, "
                         f"{BUDGET} - {decoders} = {chunk}, goes to {r4}'s first chunk: a "
                         f"**{v1.records[a4 - 1].kind}** step. {r4} samples nothing yet: its chunk ends short of its last prompt token.")),
        "v_ttft": Exercise(
            "v_ttft", f"Counting step {a4} as the first, in how many steps does {r4} get its **first output "
            f"token**? (The decoding requests keep running all along.)", "number", ttft, unit="steps",
            slips=[Slip("budget-only", math.ceil(long_len / BUDGET),
                        f"That is {long_len} / {BUDGET} rounded up: as if {r4} had the whole budget every step. The "
                        f"running requests' decode tokens come out of it first, in every step."),
                   Slip("extra-step", ttft + 1,
                        "One step too many: the first output token is not a step of its own. The step that "
                        "computes the last prompt token samples the first output token."),
                   Slip("paper", steps_to_first_token(paper, LONG),
                        "That is the paper's scheduler, which computes the whole prompt in one prefill step. In "
                        f"V1 the budget of {BUDGET} caps every step.")],
            explanation=(f"{r4}'s prompt went in chunks of at most {chunk} tokens, one chunk per step (steps "
                         f"{a4}-{first_token_step(v1, r4)}); the step with the last chunk also sampled its first "
                         "output token.")),
        "v_step": Exercise(
            "v_step", f"**Be the V1 scheduler.** {r5} ({second_len} prompt tokens) arrives just before step {a5}. "
            f"Write how many tokens each request computes in step {a5}, in the order {', '.join(ids)} "
            f"(0 for a request that computes none).", "list", row,
            slips=[Slip("one-prefill-at-a-time", one_prefill,
                        f"You kept {r5} waiting until {r4}'s prompt was done. V1 admits the next waiting request "
                        "in the same step whenever budget is left after the running requests, and gives it a "
                        "chunk of what is left."),
                   Slip("no-cap", no_cap,
                        f"That step would compute {sum(no_cap)} tokens, more than the budget of {BUDGET}: a "
                        f"waiting request gets only what is left of the budget, and {r5}'s rest comes in later "
                        "steps."),
                   Slip("paper", paper_row,
                        "That is what the paper's scheduler does in this step: a prefill step for the new "
                        "prompt alone. V1 serves the running requests first.")],
            tags={"allocator", "transfer"},
            explanation=(f"Running requests first: {shorts} a decode token each, {r4} the last "
                         f"{row[LONG]} tokens of its prompt (this step samples its first output token). That "
                         f"leaves {BUDGET - sum(row[:SECOND])} of the {BUDGET} for {r5}, the head of the waiting "
                         f"queue: its first chunk.")),
        "p_stall": Exercise(
            "p_stall", f"**The paper's semantics (vLLM V0)**, the same five requests arriving at the same steps. "
            f"Between its first output token and its last, in how many steps does {r1} compute **no** token?",
            "number", len(p_stalls), unit="steps",
            slips=[Slip("v1", len(stalled_steps(v1, r1)),
                        f"That is V1's answer. The paper's scheduler runs a new prompt in a prefill step of its "
                        f"own, and a prefill step has no decode tokens: {r1} waits through it."),
                   Slip("one-arrival", len(r4_only),
                        f"You counted {r4}'s prefill step; {r5}'s prompt gets a prefill step of its own too."),
                   Slip("chunk-steps", len(v1_prefill_steps),
                        "That counts every step in which V1 computed a chunk of a prompt. The paper computes "
                        "each prompt whole, in one step.")],
            explanation=(f"{r1} got no token in steps {_steps(p_stalls)}: the prefill steps of "
                         f"{_and(sorted({x.request_id for s in p_stalls for x in paper.records[s - 1].scheduled}))}. "
                         + (f"In V1 (budget {BUDGET}) it got a token in every step from its first to its last."
                            if not stalled_steps(v1, r1) else
                            f"In V1 (budget {BUDGET}) it got none in steps {_steps(stalled_steps(v1, r1))}."))),
        "s_ttft16": Exercise(
            "s_ttft16", f"**vLLM V1 again, budget {SMALL_BUDGET}** instead of {BUDGET}, the same requests. Counting "
            f"step {a4} as the first, in how many steps does {r4} get its first output token?", "number", ttft16,
            unit="steps",
            slips=[Slip("budget-only", math.ceil(long_len / SMALL_BUDGET),
                        f"That is {long_len} / {SMALL_BUDGET} rounded up: it forgets the decode tokens, which "
                        f"come out of the budget first in every step."),
                   Slip("same", ttft,
                        f"That is the answer for a budget of {BUDGET}. With less budget per step, {r4}'s chunks "
                        "are smaller, so there are more of them."),
                   Slip("last-chunk", long_len // per_step16,
                        f"{long_len} / {per_step16} rounded down: the last, partial chunk is a step too.")],
            tags={"transfer"},
            explanation=(f"In each step {decoders16} decode tokens come first, leaving chunks of at most "
                         f"{per_step16} tokens for {r4}: steps {a4}-{first_token_step(small, r4)}, the last of "
                         "which samples its first output token.")),
        "s_finish": Exercise(
            "s_finish", f"With the budget of {SMALL_BUDGET}, {r1} writes its last token ... (compared with the run "
            f"at {BUDGET})", "choice", r1_when, options=when,
            slips=[Slip(when_slips[o][0], o, when_slips[o][1]) for o in when if o != r1_when],
            tags={"transfer"},
            explanation=(f"{r1} wrote its last token at step {last16} with a budget of {SMALL_BUDGET} and at step "
                         f"{last32} with {BUDGET}. "
                         + ("Running requests are served first, and a decoding request needs one token per step, "
                            "so here the budget only decides how fast the prompts behind them are computed."
                            if last16 == last32 else "")),
            answer_phrases=[f"{r1} writes its last token {r1_when}", f"{r1} finishes {r1_when}"]
                           + (["the budget only decides how fast the prompts", "finishes at the same step"]
                              if last16 == last32 else [])),
    }


# ----------------------------------------------------------------------------------------- figures
def step_figure(run: EngineRun, title: str, budget: int | None = None, y_max: int | None = None):
    """Tokens each request computed in each step, stacked: one colour per request, prompt tokens (a whole
    prompt or a chunk) hatched, decode tokens plain; V1's token ``budget`` as a dashed line; each step in
    which a request that had begun its reply got no token marked above its bar. ``y_max``: a fixed height
    for the y axis, so two runs' figures compare at one scale."""
    import plotly.graph_objects as go

    from viz.colors import request_colors
    from viz.steps import step_parts

    colors = request_colors(run.request_ids)
    steps = [r.step for r in run.records]
    fig = go.Figure()
    for rid in run.request_ids:
        counts = {"prefill": [], "decode": []}
        where = []
        for rec in run.records:
            parts = [p for p in step_parts(rec) if p["request_id"] == rid]
            for kind in counts:
                counts[kind].append(sum(p["num_tokens"] for p in parts if p["kind"] == kind))
            where.append(", ".join(f"positions {p['start']}-{p['end']}" for p in parts if p["kind"] == "prefill"))
        # two traces per request, one legend entry (the plain colour): prompt tokens hatched, decode plain
        fig.add_trace(go.Bar(x=steps, y=counts["prefill"], name=rid, legendgroup=rid, showlegend=False,
                             marker={"color": colors[rid], "pattern": {"shape": "/", "fillmode": "overlay",
                                                                     "fgcolor": "white", "fgopacity": 0.8}},
                             customdata=where,
                             hovertemplate=f"step %{{x}}: {rid}, %{{y}} prompt tokens (%{{customdata}})"
                                           "<extra></extra>"))
        fig.add_trace(go.Bar(x=steps, y=counts["decode"], name=rid, legendgroup=rid, marker={"color": colors[rid]},
                             hovertemplate=f"step %{{x}}: {rid}, a decode token<extra></extra>"))
    if budget:
        fig.add_hline(y=budget, line={"dash": "dash", "color": "#D55E00"},
                      annotation_text=f"token budget {budget}", annotation_position="top left")
    tallest = max(r.num_tokens for r in run.records)
    for step in summary(run)["stalls"]:
        waiting = [r for r in run.request_ids if step in stalled_steps(run, r)]
        fig.add_annotation(x=step, y=run.records[step - 1].num_tokens, yanchor="bottom", showarrow=False,
                           text=f"{_ids(waiting)}: no token", font={"size": 11, "color": "#D55E00"})
    top = y_max or max(tallest, budget or 0)
    fig.update_layout(barmode="stack", title={"text": title, "font": {"size": 14}}, height=300,
                      margin={"l": 10, "r": 10, "t": 60, "b": 10}, plot_bgcolor="white",
                      legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "x": 0, "traceorder": "normal"},
                      xaxis={"title": "step", "tickformat": "d"},
                      yaxis={"title": "tokens computed", "range": [0, top * 1.12]})
    return fig


def _ids(ids: list[str]) -> str:
    """"R1-R3" for consecutive request ids, else a list."""
    nums = [int(r[1:]) for r in ids if r[1:].isdigit()]
    if len(ids) > 2 and len(nums) == len(ids) and nums == list(range(nums[0], nums[0] + len(nums))):
        return f"{ids[0]}-{ids[-1]}"
    return ", ".join(ids)


def _chart(fig, key: str, caption: bool = True) -> None:
    import streamlit as st

    st.plotly_chart(fig, width="stretch", key=key, config={"displayModeBar": False})
    if caption:
        st.caption(LEGEND)


LEGEND = ("One colour per request; hatched: prompt tokens (a whole prompt or a chunk of it); plain: decode tokens; "
          "a label above a bar names the requests that had begun their reply but got no token in that step. Hover "
          "a bar for the positions.")


def _table(run: EngineRun, steps: list[int], ids: list[str] | None = None):
    import pandas as pd

    ids = ids or run.request_ids
    rows = []
    for s in steps:
        counts = tokens_per_step(run)[s - 1]
        rows.append({"step": s, "kind": run.records[s - 1].kind, **{r: counts.get(r, 0) for r in ids},
                     "tokens": sum(counts.get(r, 0) for r in ids)})
    return pd.DataFrame(rows)


def reveal_v_chunk(ctx) -> None:
    import streamlit as st

    _, v1, _ = _runs(ctx)
    a4 = WORKLOAD[LONG].step
    st.dataframe(_table(v1, [a4], v1.request_ids[:LONG + 1]), hide_index=True)
    st.caption(f"vLLM V1, budget {BUDGET}: tokens each request computed in step {a4}, from the step's record.")


def reveal_v_ttft(ctx) -> None:
    import streamlit as st

    _, v1, _ = _runs(ctx)
    r4 = v1.request_ids[LONG]
    first = first_token_step(v1, r4)
    lines = []
    for s in range(WORKLOAD[LONG].step, first + 1):
        rec = v1.records[s - 1]
        decode = sum(1 for r in v1.request_ids[:SHORT] if any(x.request_id == r for x in rec.scheduled))
        part = next(x for x in rec.scheduled if x.request_id == r4)
        end = part.start_pos + part.num_tokens - 1
        sampled = next((t for sid, t in rec.new_text.items() if _rid(sid) == r4), None)
        tail = f", and samples its first output token {sampled!r}" if sampled is not None else ""
        lines.append(f"- step {s}: {decode} decode tokens, then {r4}'s prompt positions {part.start_pos}-{end} "
                     f"({part.num_tokens} tokens){tail}")
    st.markdown(f"**vLLM V1, budget {BUDGET}** (from the step records):\n" + "\n".join(lines))


def reveal_v_step(ctx) -> None:
    import streamlit as st

    from viz.steps import describe_step

    _, v1, _ = _runs(ctx)
    a5 = WORKLOAD[SECOND].step
    st.markdown(f"The engine's step {a5}, in words: *{describe_step(v1.records[a5 - 1], BUDGET)}*.")
    _chart(step_figure(v1, f"vLLM V1, budget {BUDGET}: tokens per request per step", BUDGET), "l7_fig_v1")


def reveal_p_stall(ctx) -> None:
    import streamlit as st

    paper, v1, _ = _runs(ctx)
    top = max(largest_step(paper), largest_step(v1))
    left, right = st.columns(2)
    with left:
        _chart(step_figure(paper, "the paper's semantics (vLLM V0)", y_max=top), "l7_fig_paper", caption=False)
    with right:
        _chart(step_figure(v1, f"vLLM V1, budget {BUDGET}", BUDGET, y_max=top), "l7_fig_v1_again", caption=False)
    st.caption(f"The same requests at one scale. {LEGEND} Steps in which a request that had begun its reply got no "
               f"token: paper {_steps(summary(paper)['stalls'])}; vLLM V1 {_steps(summary(v1)['stalls'])}.")


def reveal_s_ttft16(ctx) -> None:
    _, _, small = _runs(ctx)
    _chart(step_figure(small, f"vLLM V1, budget {SMALL_BUDGET}: tokens per request per step", SMALL_BUDGET),
           "l7_fig_small")


def compare_rows(runs: dict[str, EngineRun]) -> list[dict]:
    """One row per run: the long prompt's and the second prompt's time to first token (steps from arrival,
    both counted), the first short request's last step, the largest step (tokens), the stalled steps (a
    request that had begun its reply got no token) and the steps in all."""
    rows = []
    for label, run in runs.items():
        s, ids = summary(run), run.request_ids
        rows.append({"run": label, f"{ids[LONG]}: steps to 1st token": s["r4_ttft"],
                     f"{ids[SECOND]}: steps to 1st token": s["r5_ttft"], f"{ids[0]}: last token at step": s["r1_last"],
                     "largest step (tokens)": s["largest"], "stalled steps": _steps(s["stalls"]), "steps": s["steps"]})
    return rows


TABLE_NOTE = ("Steps to 1st token: from the request's arrival to the step that samples its first token, both "
              "counted. Stalled steps: steps in which a request that had begun its reply got no token.")


def reveal_s_finish(ctx) -> None:
    import pandas as pd
    import streamlit as st

    paper, v1, small = _runs(ctx)
    st.dataframe(pd.DataFrame(compare_rows({"paper (vLLM V0)": paper, f"vLLM V1, budget {BUDGET}": v1,
                                            f"vLLM V1, budget {SMALL_BUDGET}": small})), hide_index=True)
    st.caption(TABLE_NOTE)


def widget_budgets(ctx) -> None:
    import pandas as pd
    import streamlit as st

    from lessons.render import keep

    labels = {"paper (vLLM V0)": ("paper", None)} | {f"vLLM V1, budget {b}": ("v1", b) for b in WIDGET_BUDGETS}
    keep(keep_l7_run=f"vLLM V1, budget {BUDGET}")
    with st.container(border=True):
        label = st.radio("Run the same five requests with", list(labels), horizontal=True, key="keep_l7_run")
        semantics, budget = labels[label]
        run = ctx.run(arrivals_run, semantics, budget)
        _chart(step_figure(run, f"{label}: tokens per request per step", budget), "l7_fig_explore")
        st.dataframe(pd.DataFrame(compare_rows({label: run})), hide_index=True)
        st.caption(TABLE_NOTE)


if __name__ == "__main__":
    from lessons.render import render_lesson

    render_lesson(__file__)

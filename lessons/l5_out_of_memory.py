"""Lesson 5: when memory runs out. The same five requests on the embedded model: a tight pool with
preemption by recompute, the same with swap, a roomy pool as the reference for the outputs, and two
situations the text does not work through: the requests arriving in the other order, and a swap pool too
small for the victim. What each preemption cost (tokens recomputed, bytes swapped, the steps' wall time) is
read from the runs' step records (``engine.metrics.preemption_cost``)."""

from __future__ import annotations

from engine import LLMEngine
from engine.metrics import blocks_for, preemption_cost
from engine.records import plural
from engine.scenarios.presets import get_scenario
from engine.scenarios.run_spec import RunSpec
from lessons import batch_invariance
from lessons.common import EngineRun, run_engine, scenario_requests, scenario_run
from lessons.exercise import Exercise, Slip

SCENARIO = "memory-pressure"  # engine/scenarios/presets.py; the Playground button loads the same preset
ROOMY_BLOCKS = 64  # a pool big enough that nobody is preempted: the reference for the outputs
POLICIES = {"recompute (tight pool)": "recompute", "swap (tight pool)": "swap", "roomy pool (no pressure)": "roomy"}
TINY_SWAP = 1  # swap-pool blocks in the fallback question: fewer than any running request holds then
NOBODY = "nobody: no request is preempted"
SAME_OPTIONS = ["yes, token for token", "no: recomputing gives slightly different numbers",
                "only with swap; recompute changes it"]
SAME_SLIPS = ["same", "recompute-differs", "swap-only"]  # one per SAME_OPTIONS entry
FALLBACK_OPTIONS = {"recompute": "it preempts the victim by recompute instead",
                    "partial": "it swaps out the blocks that fit and frees the others",
                    "wait": "the request that needs a block skips this step and waits",
                    "error": "the engine stops with an out-of-memory error"}

V0_SWAP_ERROR = ("its scheduler raised \"Aborted due to the lack of CPU swap space. "
                 "Please increase the swap space to avoid this error.\" (`vllm/core/scheduler.py`, `_swap_out`)")

RECAP = [
    "A paged server admits a request as soon as its prompt's blocks are free, so memory can run out "
    "**mid-generation**, when several running requests need a new block in the same step.",
    "Then the scheduler preempts the running request admitted **last** (first come, first served), so the "
    "order in which requests arrive decides who is preempted.",
    "Recompute frees the victim's blocks and later prefills all its tokens again ({{ recomputed }} tokens in "
    "this run); swap copies its blocks to CPU memory and back ({{ swap_kib }} KiB here) and computes nothing "
    "again.",
    "When the swap pool has no room for the victim's blocks, this engine falls back to recompute (vLLM V0 "
    "stopped with an error there; vLLM V1 only recomputes).",
    "In greedy decoding on this CPU float32 engine every reply came out identical, token for token: preemption "
    "changed when a request ran, not what it computed. That is a measurement, not a law: vLLM on GPUs is not "
    "batch-invariant, and even here {{ bi_short }}.",
]


# --------------------------------------------------------------------------------------------- runs
def requests(tokenizer) -> list:
    """The scenario's (prompt token ids, params) pairs."""
    return scenario_requests((None, tokenizer), SCENARIO)


def _config(**overrides) -> dict:
    config = {k: v for k, v in get_scenario(SCENARIO).engine_defaults.items() if k != "reservation_tokens"}
    config.update(overrides)
    return config


def pressure_run(loaded, policy: str):
    """policy: "recompute", "swap" (the scenario's tight pool) or "roomy" (a pool big enough for everything)."""
    if policy == "roomy":
        return scenario_run(loaded, SCENARIO, num_blocks=ROOMY_BLOCKS)
    return scenario_run(loaded, SCENARIO, preemption_mode=policy)


def fallback_run(loaded) -> EngineRun:
    """The tight pool in swap mode with a swap pool of ``TINY_SWAP`` blocks, up to its first preemption."""
    return _run(loaded, None, True, preemption_mode="swap", swap_space_blocks=TINY_SWAP)


def ordered_run(loaded, order: tuple[str, ...]) -> EngineRun:
    """The scenario's requests (recompute mode), added in ``order`` of their scenario ids (``R1`` is the
    scenario's first request): the same requests under the same names, arriving in another order; up to
    its first preemption (to the end if there is none)."""
    return _run(loaded, order, True)


def _run(loaded, order: tuple[str, ...] | None, stop_at_preemption: bool, **overrides) -> EngineRun:
    """The scenario on a fresh engine (its settings, then ``overrides``), its requests added in ``order`` of
    their scenario ids (default: the scenario's), stepped to the end or, with ``stop_at_preemption``, to the
    end of the step that first preempts someone (the lesson's questions look no further)."""
    pairs = scenario_requests(loaded, SCENARIO)
    order = order or tuple(f"R{i + 1}" for i in range(len(pairs)))
    parts = [f"arrival order {', '.join(order)}"] * (order != tuple(sorted(order)))
    parts += [f"{k}={v}" for k, v in overrides.items()]
    label = SCENARIO + (f" ({', '.join(parts)})" if parts else "")
    preempts = (lambda record: any(e.kind == "preempt" for e in record.events)) if stop_at_preemption else None
    return run_engine(loaded, [pairs[int(rid[1:]) - 1] for rid in order], label=label, request_ids=list(order),
                      stop=preempts, **_config(**overrides))


def block_bytes(loaded) -> int:
    """Bytes of one block of the tight pool in the engine's own KV tensors (K and V, every layer)."""
    engine = LLMEngine(RunSpec(**_config()).engine_config("paged"), loaded)
    return engine.kv_cache.nbytes // engine.num_blocks


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


# ------------------------------------------------------------------------------------------ figures
def _other_order(ids: list[str]) -> tuple[str, ...]:
    return tuple(reversed(ids))


def first_preemption(run) -> dict:
    """The first preemption of a run: its record index, event, victim, the requester (the request whose
    next token needed the blocks), and who was running just before (admission order)."""
    i, e = run.first("preempt")
    if e is None:
        return {"index": None, "event": None, "victim": None, "needy": None, "running": []}
    return {"index": i, "event": e, "victim": e.request_id, "needy": e.data["reason"].split()[0],
            "running": list(run.records[i - 1].snapshot.running)}


def swap_round_trip(run, victim: str, bytes_per_block: int) -> dict:
    """The victim's first swap out and the swap in that brings it back: blocks each way and bytes."""
    out = next(e for e in run.events("swap_out") if e.request_id == victim)
    seen_out = False
    back = None
    for rec in run.records:
        for e in rec.events:
            if e is out:
                seen_out = True
            elif seen_out and e.kind == "swap_in" and e.request_id == victim:
                back = e
                break
        if back is not None:
            break
    n_out, n_in = len(out.data["pairs"]), len(back.data["pairs"]) if back else 0
    return {"out": out, "in": back, "out_blocks": n_out, "in_blocks": n_in,
            "bytes": (n_out + n_in) * bytes_per_block}


def costs(ctx) -> dict:
    """``preemption_cost`` of the recompute and the swap run, with the block size in bytes."""
    per_block = ctx.run(block_bytes)
    return {p: preemption_cost(ctx.run(pressure_run, p).records, per_block) for p in ("recompute", "swap")}


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.1f} ms"


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
    pairs = requests(ctx.loaded[1])
    prompts = [len(p) for p, _ in pairs]
    params = [sp for _, sp in pairs]
    per_block = ctx.run(block_bytes)
    cost = costs(ctx)
    rec, swp = cost["recompute"], cost["swap"]
    return {"late_note": note, "num_blocks": run.num_blocks, "block_size": run.block_size,
            "small_ids": ", ".join(ids[:-1]), "small_prompt": prompts[0], "small_tokens": params[0].max_tokens,
            "big_id": ids[-1], "big_prompt": prompts[-1], "big_tokens": params[-1].max_tokens,
            "kv_token_bytes": per_block // run.block_size, "order_text": ", ".join(_other_order(ids)),
            "tiny_swap": TINY_SWAP,
            "recomputed": rec["recomputed_tokens"], "swap_kib": f"{swp['swap_bytes'] / 1024:,.0f}",
            "rec_preemptions": plural(rec["preemptions"], "preemption"),
            "swap_preemptions": plural(swp["preemptions"], "preemption"),
            "rec_time": _ms(rec["recompute_s"]), "swap_time": _ms(swp["swap_s"]),
            "plain_time": _ms(rec["plain_decode_s"]),
            "rec_steps": plural(len(rec["recompute_steps"]), "re-admission step"),
            "swap_steps": plural(len(swp["swap_steps"]), "step"), **batch_invariance.facts()}


def exercises(ctx) -> dict[str, Exercise]:
    rec_run, swap_run, roomy = (ctx.run(pressure_run, p) for p in ("recompute", "swap", "roomy"))
    ids = rec_run.request_ids
    B = rec_run.block_size
    pairs = requests(ctx.loaded[1])
    prompt_len, max_tokens = len(pairs[0][0]), pairs[0][1].max_tokens
    max_len = get_scenario(SCENARIO).engine_defaults["max_model_len"]
    return {**_pool_exercises(ctx, rec_run, ids, B, prompt_len, max_len),
            **_victim_exercises(ctx, rec_run, ids),
            **_cost_exercises(ctx, rec_run, swap_run, B, prompt_len, max_tokens),
            **_outcome_exercises(ctx, rec_run, swap_run, roomy, ids)}


def _pool_exercises(ctx, rec_run, ids, B, prompt_len, max_len) -> dict[str, Exercise]:
    first = rec_run.records[0]
    admitted = [e.request_id for e in first.events if e.kind == "admit"]
    waits = [e for e in first.events if e.kind == "wait"] or [e for e in rec_run.records[1].events if e.kind == "wait"]
    fp = first_preemption(rec_run)
    i = fp["index"]
    step = rec_run.records[i].step
    position = next(e.data["position"] for e in rec_run.records[i].events if e.kind == "new_block")
    return {
        "m_admit": Exercise(
            "m_admit", f"How many of the {len(ids)} requests does the first step admit?", "number", len(admitted),
            unit="requests",
            explanation=(f"{', '.join(admitted)} take {first.snapshot.num_used_blocks} blocks; "
                         + (f"the engine said: *{waits[0].message}*." if waits else "")),
            slips=[Slip("everyone", len(ids),
                        f"Admission needs the prompt's blocks free **now**: once {', '.join(admitted)} hold "
                        f"theirs, {first.snapshot.num_free_blocks} blocks are left, fewer than the long prompt "
                        "needs."),
                   Slip("contiguous-reservation", rec_run.num_blocks // blocks_for(max_len, B),
                        "That is how a contiguous server admits: a region for the maximum length per request. "
                        "A paged server takes blocks for the prompt only, and the reply's blocks one at a time.")]),
        "m_step": Exercise(
            "m_step", f"The running requests each hold {prompt_len} prompt tokens and write one token per step from "
            "step 2 on (step 1 is the prefill, which also samples the first new token). At which **step** does the "
            "pool run out, so that someone is preempted?", "number", step,
            explanation=(f"Step {step} writes token {position}, the first of a new block of {B}, for every running "
                         f"request at once: {len(fp['running'])} requests need a block each and "
                         f"{rec_run.records[i - 1].snapshot.num_free_blocks} are free. Somebody has to give up "
                         "theirs."),
            slips=[Slip("sampled-not-written", step - 1,
                        f"Off by one: at that step token {position} is **sampled**; its keys and values are "
                        "written, and the new block is needed, at the next step."),
                   Slip("tokens-that-fit", position - prompt_len,
                        f"That is how many new tokens still fit in the prompt's blocks ({position - prompt_len}); "
                        "the question asks for the step number, and step 1 is the prefill.")],
            answer_phrases=[f"runs out at step {step}", f"step {step} writes token {position}",
                            f"preempted at step {step}"]),
    }


def _status_before(run, index: int, rid: str) -> str:
    """"finished", "waiting" or "running": where ``rid`` is just before record ``index``."""
    snap = run.records[index - 1].snapshot if index else None
    if snap is not None and rid in snap.running:
        return "running"
    finished = any(e.kind == "finish" and e.request_id == rid for rec in run.records[:index] for e in rec.events)
    return "finished" if finished else "waiting"


def _why_not(run, p: dict, rid: str) -> tuple[str, str]:
    """(slip name, message) for naming ``rid`` as the victim of ``run``'s first preemption ``p`` (or when
    nobody is preempted)."""
    if p["victim"] is None:
        return f"not-{rid}", (f"Nobody is preempted in this order: the pool never runs out while {rid} or any "
                              "other request runs.")
    status = _status_before(run, p["index"], rid)
    if status != "running":
        where = "has finished by then" if status == "finished" else "is still waiting at the door"
        return f"not-running-{rid}", f"{rid} {where}: it holds no blocks, so preempting it would free nothing."
    if rid == p["needy"]:
        return "requester", (f"{rid} is the request that needs a block. The scheduler keeps it and preempts the "
                             f"running request admitted last, {p['victim']}.")
    if rid == p["running"][0]:
        return "oldest", (f"{rid} has run the longest: first come, first served protects it. The victim is the "
                          f"running request admitted last, {p['victim']}.")
    return f"middle-{rid}", (f"{rid} is neither the oldest nor the newest. The scheduler does not pick by size or at "
                             f"random but by order of admission, and {p['victim']} was admitted last.")


def _preempted(p: dict) -> str:
    """"R4 is preempted (R3 needs 1 free block, 0 are free)": the engine's reason, without the counts of blocks
    and tokens its message goes on with (later questions ask for those)."""
    return f"{p['victim']} is preempted ({p['event'].data['reason']})"


def _story(run, p: dict) -> str:
    """The admissions of ``run`` up to its first preemption, in words."""
    end = p["index"] + 1 if p["index"] is not None else len(run.records)
    parts = []
    for rec in run.records[:end]:
        admitted = [e.request_id for e in rec.events if e.kind == "admit" and not e.data["readmission"]]
        if admitted:
            parts.append(f"step {rec.step} admits {', '.join(admitted)}")
    text = "; ".join(parts)
    if p["event"] is None:
        return f"The engine ran it: {text}, and nobody is preempted in {len(run.records)} steps."
    return (f"The engine ran it: {text}. At step {run.records[p['index']].step}, running were "
            f"{', '.join(p['running'])}, in order of admission, and {_preempted(p)}.")


def _victim_exercises(ctx, rec_run, ids) -> dict[str, Exercise]:
    fp = first_preemption(rec_run)
    order = _other_order(ids)
    other = ctx.run(ordered_run, order)
    op = first_preemption(other)
    other_answer = op["victim"] or NOBODY
    victim_slips = [Slip(*_named(_why_not(rec_run, fp, r), r)) for r in ids if r != fp["victim"]]
    other_options = list(ids) + [NOBODY]
    other_slips = []
    for option in other_options:
        if option == other_answer:
            continue
        if option == NOBODY:
            other_slips.append(Slip("nobody", NOBODY, "The pool does run out in this order too; the question is "
                                    "who gives up blocks then."))
        elif option == fp["victim"] and _status_before(other, op["index"], option) == "running":
            first_in = option == op["running"][0]
            other_slips.append(Slip("same-name", option,
                                    f"{option} was the victim before only because it was admitted last"
                                    + (": in this order it is admitted first among those running, so it is the "
                                       "last one the scheduler gives up." if first_in else
                                       "; the rule follows the order of admission, not the name.")))
        else:
            other_slips.append(Slip(*_named(_why_not(other, op, option), option)))
    return {
        "m_victim": Exercise(
            "m_victim", f"You are the scheduler. At that step the engine finds: *{fp['event'].data['reason']}*. "
            f"Running are {', '.join(fp['running'])}, admitted in that order. Which request do you preempt?",
            "choice", fp["victim"], options=list(ids), tags={"allocator"},
            explanation=(f"{fp['victim']}: of the running requests it was admitted last, so the others, which have "
                         "waited longer, keep going (first come, first served). In the engine's run, "
                         f"{_preempted(fp)}, and its blocks go to the requests that need one."),
            slips=victim_slips,
            answer_phrases=[f"{fp['victim']} is preempted", "it was admitted last", "the most recently admitted",
                            "preemption of the last admitted", "the last admitted is preempted"]),
        "m_order": Exercise(
            "m_order", f"The same pool and the same five requests, but they arrive in the opposite order: "
            f"{', '.join(order)}. Which request is preempted first?", "choice", other_answer,
            options=other_options, tags={"transfer", "allocator"},
            explanation=_story(other, op) + " The rule did not change; the order of arrival it reads did.",
            slips=other_slips,
            answer_phrases=[f"{other_answer} is preempted", f"{other_answer} is preempted first"]),
    }


def _named(pair: tuple[str, str], answer: str) -> tuple[str, str, str]:
    """(name, answer, message) for ``Slip`` from ``_why_not``'s (name, message)."""
    return pair[0], answer, pair[1]


def _cost_exercises(ctx, rec_run, swap_run, B, prompt_len, max_tokens) -> dict[str, Exercise]:
    fp = first_preemption(rec_run)
    i, victim = fp["index"], fp["victim"]
    readmit = next(e for rec in rec_run.records[i + 1:] for e in rec.events
                   if e.kind == "allocate" and e.request_id == victim)
    held = next(seq.num_tokens for seq in rec_run.records[i - 1].snapshot.sequences if seq.seq_id == victim)
    generated = readmit.data["num_tokens"] - prompt_len
    sp = first_preemption(swap_run)
    per_block = ctx.run(block_bytes)
    trip = swap_round_trip(swap_run, sp["victim"], per_block)
    swap_out = trip["out"]
    kib = trip["bytes"] / 1024
    per_token = per_block // B
    return {
        "m_recompute": Exercise(
            "m_recompute", f"With **recompute**, {victim} is prefilled again when it is admitted again. How many "
            "tokens does that prefill compute?", "number", readmit.data["num_tokens"], unit="tokens",
            explanation=(f"{held} tokens had their keys and values in its blocks, plus the last token it sampled, "
                         "which had not been written yet (the next decode step would have done that): "
                         f"{readmit.data['num_tokens']}. The engine said, when {victim} came back: "
                         f"*{readmit.message}*."),
            slips=_distinct(readmit.data["num_tokens"], [
                Slip("stored-only", held,
                     "That counts the tokens whose keys and values were in its blocks; the token it sampled last "
                     "had none yet, and the prefill computes it too."),
                Slip("prompt-only", prompt_len,
                     "That is its prompt alone. The tokens it generated are part of its sequence now; their keys "
                     "and values were freed with its blocks, so they are computed again too."),
                Slip("generated-only", generated,
                     "That is what it had generated; its prompt's keys and values were freed too, so the prefill "
                     "computes the prompt again as well."),
            ])),
        "m_swap": Exercise(
            "m_swap", f"With **swap** instead, how many blocks does {sp['victim']} copy to the CPU when it is "
            "preempted?", "number", len(swap_out.blocks), unit="blocks",
            explanation=f"The engine said: *{swap_out.message}*",
            slips=_distinct(len(swap_out.blocks), [
                Slip("next-token-block", blocks_for(held + 1, B),
                     "That counts the block its next token would have needed; it never got that block, so only "
                     "the blocks it holds are copied."),
                Slip("final-length", blocks_for(prompt_len + max_tokens - 1, B),
                     "That is what it would hold at its final length; a swap copies the blocks it holds now."),
            ])),
        "m_bytes": Exercise(
            "m_bytes", f"How many **KiB** cross the bus for this one preemption: {sp['victim']}'s blocks copied to "
            "the CPU, and later copied back?", "number", kib, unit="KiB",
            rel_tolerance=0.01,
            explanation=(f"{trip['out_blocks']} blocks out and {trip['in_blocks']} back in, each {B} slots × "
                         f"{per_token:,} bytes = {per_block // 1024:,} KiB: {kib:,.0f} KiB. The engine said, as "
                         f"they came back: *{trip['in'].message}*"),
            slips=_distinct(kib, [
                Slip("one-way", trip["out_blocks"] * per_block / 1024,
                     "That is one way only. The blocks cross the bus twice: out to the CPU, and back into "
                     "free GPU blocks when the request resumes."),
                Slip("per-token", (trip["out_blocks"] + trip["in_blocks"]) * per_token / 1024,
                     f"That counts one token per block; a block holds {B} token slots, and all of them are "
                     "copied."),
                Slip("bytes-not-kib", trip["bytes"],
                     "That is in bytes; the question asks for KiB (1 KiB = 1,024 bytes)."),
            ])),
    }


def _outcome_exercises(ctx, rec_run, swap_run, roomy, ids) -> dict[str, Exercise]:
    tiny = ctx.run(fallback_run)
    tp = first_preemption(tiny)
    mode = tp["event"].data["mode"] if tp["event"] is not None else None
    held_blocks = len(tp["event"].blocks) if tp["event"] is not None else 0
    fallback_answer = FALLBACK_OPTIONS["recompute" if mode == "recompute" else "partial"]
    same = all(rec_run.outputs[r].output_token_ids == roomy.outputs[r].output_token_ids ==
               swap_run.outputs[r].output_token_ids for r in ids)
    same_answer = SAME_OPTIONS[0] if same else SAME_OPTIONS[1]
    bi = batch_invariance.facts()
    fallback_messages = {
        "recompute": "It does: recompute needs no room anywhere, so it is always possible.",
        "partial": (f"A request is swapped whole or not at all: it resumes only when all its blocks are back, so "
                    f"half its blocks on the CPU would help nobody. With room for {TINY_SWAP} of its "
                    f"{held_blocks} blocks it is preempted by recompute."),
        "wait": ("A decode step cannot skip a request's token and wait: that request is in the batch and needs "
                 "its slot now. Someone must give up blocks, here by recompute."),
        "error": ("Not this engine: it preempts by recompute, which needs no room anywhere. You are right about "
                  "vLLM V0, though: " + V0_SWAP_ERROR + "."),
    }
    same_messages = {
        SAME_OPTIONS[0]: "The engine compared the runs and found a difference.",
        SAME_OPTIONS[1]: ("Recomputing runs the same model on the same tokens. The numbers can differ in the last "
                          "bits of float32 rounding (a prefill multiplies matrices of other shapes than the decode "
                          "steps did), but far too little to change which token is the most likely here."),
        SAME_OPTIONS[2]: ("Recompute computes the victim's keys and values again from the same tokens, with the "
                          "same result; the replies match in both modes."),
    }
    return {
        "m_fallback": Exercise(
            "m_fallback", f"Swap mode again, but the CPU swap pool now has room for only {TINY_SWAP} "
            f"block{'s' * (TINY_SWAP != 1)}. When the pool runs out, what does this engine's scheduler do?", "choice",
            fallback_answer, options=list(FALLBACK_OPTIONS.values()), tags={"transfer"},
            explanation=((f"The engine ran it: *{tp['event'].message.rstrip()}*{'' if tp['event'].message.rstrip().endswith(('.', '!', '?')) else '.'}" if tp["event"] is not None else
                          "The engine ran it: nobody was preempted.")
                         + f" That is this engine's choice; in vLLM V0 {V0_SWAP_ERROR}. vLLM V1 has no swap: it only "
                         "recomputes."),
            slips=[Slip(k, o, fallback_messages[k]) for k, o in FALLBACK_OPTIONS.items() if o != fallback_answer],
            answer_phrases=[fallback_answer] + (["falling back to recompute", "falls back to recompute",
                                                 "swap pool full"] if "recompute" in fallback_answer else [])),
        "m_same": Exercise(
            "m_same", "Is every request's reply (greedy decoding) the same as in a run with a roomy pool where "
            "nobody is preempted?", "choice", same_answer, options=SAME_OPTIONS,
            explanation=("The engine compared the recompute, swap and roomy runs: " + ("every request's tokens are "
                         "identical" if same else "they differ") + ". Preemption changes when a request runs, not "
                         "what it computes: its keys and values are recomputed from the same tokens, or copied "
                         "back bit for bit. That holds for greedy decoding on this CPU float32 engine. With seeded "
                         "sampling a draw can land so close to the boundary between two tokens that float rounding "
                         f"decides; measured on this engine, {bi['bi_long']}. vLLM on GPUs is not batch-invariant "
                         "either: the batch changes the order of its floating-point sums."),
            slips=[Slip(name, o, same_messages[o]) for name, o in zip(SAME_SLIPS, SAME_OPTIONS) if o != same_answer],
            answer_phrases=[same_answer] + (["every request's tokens are identical", "recompute gives the same tokens",
                                             "preemption changes when a request runs, not what it computes",
                                             "same tokens after preemption"] if same else [])),
    }


def _distinct(expected, slips: list[Slip]) -> list[Slip]:
    """The slips whose answers differ from ``expected`` and from each other (the first of equal ones)."""
    seen, out = [expected], []
    for s in slips:
        if all(abs(s.answer - v) > 1e-9 * max(1.0, abs(v)) for v in seen):
            seen.append(s.answer)
            out.append(s)
    return out


# ------------------------------------------------------------------------------------------- widgets
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


def cost_rows(ctx) -> list[dict]:
    """One row per preemption mode: what the run's preemptions cost, from its step records."""
    cost = costs(ctx)
    rows = []
    for mode, c in cost.items():
        run = ctx.run(pressure_run, mode)
        steps = c["recompute_steps"] if mode == "recompute" else c["swap_steps"]
        seconds = c["recompute_s"] if mode == "recompute" else c["swap_s"]
        rows.append({"policy": mode, "steps": len(run.records), "preemptions": c["preemptions"],
                     "tokens computed again": c["recomputed_tokens"],
                     "blocks to CPU / back": f"{c['swap_out_blocks']} / {c['swap_in_blocks']}",
                     "KiB over the bus": round(c["swap_bytes"] / 1024),
                     "steps that paid": ", ".join(map(str, steps)) or "none",
                     "their wall time": _ms(seconds), "a plain decode step": _ms(c["plain_decode_s"])})
    return rows


def cost_table(rows: list[dict]) -> list[dict]:
    """``cost_rows`` turned on its side: one row per quantity, one column per policy, so the table is three
    columns wide and fits a 1280-pixel screen (nine columns were cut off at the right)."""
    policies = [r["policy"] for r in rows]
    return [{"": key, **{p: (f"{r[key]:,}" if isinstance(r[key], int) else str(r[key])) for p, r in zip(policies, rows)}}
            for key in rows[0] if key != "policy"]


def widget_cost(ctx) -> None:
    import pandas as pd
    import streamlit as st

    with st.container(border=True):
        st.markdown("**What each policy's preemptions cost in these runs**")
        table = cost_table(cost_rows(ctx))
        st.dataframe(pd.DataFrame(table), hide_index=True, width="stretch", height=35 * (len(table) + 1) + 3)
        st.caption("Counts and bytes come from the runs' events (re-admissions, swap-outs and swap-ins; a block is "
                   f"{ctx.run(block_bytes):,} bytes of keys and values in this model's KV tensors). Wall times are "
                   "this machine's, measured by the engine around each step (`StepRecord.elapsed_s`) when these runs "
                   "were made; a step that recomputed or swapped also did the rest of its batch's work, so compare "
                   "it with a plain decode step.")


if __name__ == "__main__":
    from lessons.render import render_lesson

    render_lesson(__file__)

"""Run a conformance case through the lab's engine in V1 semantics; the result has the shape of
``peer/vllm_driver.py``'s, so ``peer.compare`` reads both the same way.

Result: ``{"settings", "requests": {id: {"outputs", "finish_reasons", "stop_reasons", "num_cached_tokens",
"child_num_cached_tokens", "num_preemptions"}}, "steps": [{"step", "scheduled", "preempted", "finished",
"finish_reasons", "kv_events", "num_free_blocks", "kv_cache_usage"}], "num_preemptions", "prefix_cache_stats",
"child_ids"}``.

``stop_reasons``: the lab's outputs have no ``stop_reason`` field (``CompletionOutput`` carries
``finish_reason`` only), so it is read off each finished completion as vLLM's ``check_stop``
(``vllm/v1/core/sched/utils.py``) sets it: the last token when the completion finished "stop" on one of
``stop_token_ids``, None when it finished on the EOS token (tested first, unless ``ignore_eos``) or on
the length limit.
"""

from __future__ import annotations

from engine import EngineConfig, LLMEngine, SamplingParams, metrics
from engine.records import EventKind

from .cases import Case


def run_case(case: Case, model: str, loaded=None) -> dict:
    """Step ``case`` through ``LLMEngine`` (semantics "v1", float32 on the CPU), adding each request after
    its ``arrival_step`` steps. ``loaded``: an already loaded ``(model, tokenizer)`` to share."""
    config = EngineConfig(model=model, semantics="v1", block_size=case.block_size, num_blocks=case.lab_num_blocks,
                          max_model_len=case.max_model_len, max_num_seqs=case.max_num_seqs,
                          max_num_batched_tokens=case.max_num_batched_tokens,
                          enable_prefix_caching=case.enable_prefix_caching,
                          scheduling_policy=case.scheduling_policy, watermark=case.watermark,
                          device="cpu", dtype="float32")
    engine = LLMEngine(config, loaded=loaded)
    pending = sorted(case.requests, key=lambda r: r.arrival_step)
    eos = engine.tokenizer.eos_token_id
    steps = []
    while pending or engine.has_unfinished():
        while pending and pending[0].arrival_step <= len(steps):
            r = pending.pop(0)
            engine.add_request(list(r.prompt_token_ids), SamplingParams(
                max_tokens=r.max_tokens, temperature=r.temperature, ignore_eos=r.ignore_eos, n=r.n,
                stop_token_ids=tuple(r.stop_token_ids), seed=case.seed), request_id=r.request_id,
                priority=r.priority)
        rec = engine.step()
        steps.append({
            "step": rec.step,
            "scheduled": {s.request_id: s.num_tokens for s in rec.scheduled},
            "preempted": [e.request_id for e in rec.events if e.kind == EventKind.PREEMPT],
            "finished": [e.request_id for e in rec.events if e.kind == EventKind.FINISH],
            "finish_reasons": {e.request_id: e.data["reason"] for e in rec.events if e.kind == EventKind.FINISH},
            "kv_events": rec.kv_events,
            "num_free_blocks": rec.snapshot.num_free_blocks,
            "kv_cache_usage": metrics.kv_cache_usage_pct(rec.snapshot) / 100,
        })
        if len(steps) > 10_000:
            raise RuntimeError(f"case {case.name}: no end after 10,000 steps")
    requests = {}
    for r in case.requests:
        out = engine.get_output(r.request_id)
        kids = engine.parents.get(r.request_id, [])
        requests[r.request_id] = {
            "outputs": [o.token_ids for o in out.outputs],
            "finish_reasons": [o.finish_reason for o in out.outputs],
            "stop_reasons": [_stop_reason(o, r, eos) for o in out.outputs],
            "num_cached_tokens": out.num_cached_tokens,
            "child_num_cached_tokens": {c: engine.get_output(c).num_cached_tokens for c in kids},
            "num_preemptions": out.num_preemptions,
        }
    stats = engine.block_manager.stats
    return {
        "settings": {"block_size": case.block_size, "num_blocks": case.lab_num_blocks,
                     "max_num_batched_tokens": engine.max_num_batched_tokens, "max_num_seqs": case.max_num_seqs,
                     "policy": case.scheduling_policy, "watermark": config.watermark,
                     "watermark_blocks": engine.scheduler.watermark_blocks},
        "requests": requests,
        "steps": steps,
        "num_preemptions": sum(len(s["preempted"]) for s in steps),
        "prefix_cache_stats": {"queries": stats["queries"], "hits": stats["hits"],
                               "preempted_queries": stats["preempted_queries"],
                               "preempted_hits": stats["preempted_hits"]},
        "child_ids": {p: list(c) for p, c in engine.parents.items()},
    }


def _stop_reason(output, request, eos: int | None) -> int | None:
    """vLLM's ``stop_reason`` of one finished completion (see the module docstring)."""
    if output.finish_reason != "stop" or not output.token_ids:
        return None
    last = output.token_ids[-1]
    if not request.ignore_eos and last == eos:
        return None
    return last if last in request.stop_token_ids else None

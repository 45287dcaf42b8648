"""Lesson 10: hybrid models, sliding-window and full-attention layers in KV cache groups (vLLM V1's hybrid
KV cache manager).

Two runs of the project's second embedded model, ``assets/tiny_hybrid_model`` (4 layers: 0 and 2 attend
over a 48-token sliding window, 1 and 3 to everything; so two KV cache groups of two layers), with
``LLMEngine(semantics="v1")``:

- ``window_run``: one request, a ``PROMPT_LEN``-token prompt prefilled in chunks of ``BUDGET`` tokens, then
  ``MAX_TOKENS`` greedy tokens. Per step: every group's block table, the blocks the request holds, the
  all-full-attention twin's blocks and ``engine.metrics.hybrid_blocks_saved`` (the one definition of the
  saving); the questions "how many blocks fewer than the twin" and "which blocks does the sliding group
  give back at this step" are read from it.
- ``prefix_run``: request A, then B (A's first ``SHARED`` tokens and its own), then C (the same prefix, its
  own tail), one after another with prefix caching on. Before each admission, every group's own cache hit
  is asked of its manager (``find_longest_cache_hit``, changing nothing), so the reveal can show the full
  group's hit against the sliding group's, and the hit the engine then took.

The real configs (``lessons/data/models/gpt-oss-20b.json``, ``gemma-3-12b.json``) go through
``lessons.kv_math``: ``group_costs`` (bytes per token per KV cache group) and ``hybrid_fit`` (requests that
fit on an 80 GB GPU, lesson 1's convention, against the all-full-attention twin).

Sources (vLLM 0.32, the copy installed in ``.peer-venv``) are listed in ``VLLM_SOURCES`` and shown at the
end of the lesson.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from engine import EMBEDDED_HYBRID_MODEL, EngineConfig, LLMEngine, SamplingParams
from engine.block_pool import prefix_hashes
from engine.metrics import blocks_for, blocks_left_window, hybrid_blocks_saved, hybrid_saving
from engine.scenarios.presets import LIFE_TEXT, PRESSURE_LONG_TEXT, PRESSURE_TEXTS, exact_prompt
from engine.single_type_kv_cache_manager import NULL_BLOCK
from lessons import kv_math
from lessons.exercise import Exercise, Slip

BLOCK_SIZE = 16
NUM_BLOCKS = 64
PROMPT_LEN, MAX_TOKENS, BUDGET = 150, 24, 64  # the window run: prefilled in chunks of BUDGET tokens
SHARED, OWN, PREFIX_OUT = 100, 40, 4         # the prefix run: B and C share A's first SHARED tokens
EXAMPLE_C = 100  # the intro's example of the window's arithmetic (computed tokens), apart from the questions'

GPU_GB = 80                        # an "80 GB" GPU: 80 x 10^9 bytes (lesson 1's convention)
CONTEXTS = (8192, 32768, 131072)   # 8k, 32k, 128k tokens per request
WORKED, TRANSFER = "gpt-oss-20b", "gemma-3-12b"
TRANSFER_CONTEXT = 32768
VLLM_SERVE_BUDGET = 8192  # vllm serve's max_num_batched_tokens on an H100-class GPU (arg_utils.get_batch_defaults)
# Batches in flight at once (VllmConfig.max_concurrent_batches, vllm/config/vllm.py): 2 with async scheduling,
# which `vllm serve` turns on by default on one GPU (VllmConfig.__post_init__: async_scheduling None -> True
# when the executor supports it; one GPU gets the "uni" executor, UniProcExecutor.supports_async_scheduling),
# 1 with --no-async-scheduling. SlidingWindowSpec.max_memory_usage_bytes budgets for
# VllmConfig.max_in_flight_tokens = max_concurrent_batches x max_num_batched_tokens.
VLLM_ASYNC_BATCHES, VLLM_SYNC_BATCHES = 2, 1

VLLM = "vllm/v1/core/"
VLLM_SOURCES = [
    ("Layers with the same kind of KV form KV cache groups of equal size; every group draws on one pool of "
     "blocks of one page size",
     f"{VLLM}kv_cache_utils.py", "_get_kv_cache_groups_uniform_page_size, get_kv_cache_config_from_groups"),
    ("A request has one block table per group; each group has its own manager",
     f"{VLLM}single_type_kv_cache_manager.py", "SingleTypeKVCacheManager.req_to_blocks, get_manager_for_kv_cache_spec"),
    ("Tokens before the window of the next token: num_computed_tokens - sliding_window + 1",
     f"{VLLM}single_type_kv_cache_manager.py", "SlidingWindowManager.get_num_skipped_tokens"),
    ("Blocks wholly before the window are freed, walked back from the window's edge, and become the null block",
     f"{VLLM}single_type_kv_cache_manager.py",
     "SingleTypeKVCacheManager.remove_skipped_blocks, _remove_blocks_in_range; BlockPool.null_block"),
    ("A full-attention hit: the longest run of cached blocks from the left",
     f"{VLLM}single_type_kv_cache_manager.py", "FullAttentionManager.find_longest_cache_hit"),
    ("A sliding-window hit: searched from the right, needing only the last ceil((window - 1) / B) blocks "
     "before the hit point; with no such run, the cached blocks from the start",
     f"{VLLM}single_type_kv_cache_manager.py",
     "SlidingWindowManager.find_longest_cache_hit, _contiguous_blocks_for_hit"),
    ("A sliding group caches only the blocks a later hit can end at (a prompt's end, a prefix others share)",
     f"{VLLM}single_type_kv_cache_manager.py, {VLLM}kv_cache_coordinator.py",
     "SlidingWindowManager.reachable_block_mask; replay_boundaries"),
    ("The coordinator settles on a hit length every group accepts (full attention first, then each other "
     "kind, shorter until none objects)",
     f"{VLLM}kv_cache_coordinator.py", "HybridKVCacheCoordinator.find_longest_cache_hit"),
    ("At start-up a sliding group is budgeted for a prompt chunk in flight: ceil((window - 1 + in-flight "
     "tokens) / B) + 1 blocks per request",
     "vllm/v1/kv_cache_interface.py, " + f"{VLLM}kv_cache_utils.py",
     "SlidingWindowSpec.max_admission_blocks_per_request; get_max_concurrency_for_kv_cache_config"),
    ("Tokens in flight: max_num_batched_tokens x the batches in flight, 2 with async scheduling (on by "
     "default on one GPU), 1 without",
     "vllm/config/vllm.py", "VllmConfig.max_concurrent_batches, max_in_flight_tokens"),
]


def admission_blocks(window: int, in_flight: int, max_model_len: int, block_size: int = BLOCK_SIZE) -> int:
    """vLLM's start-up budget for a sliding group, per request (``max_admission_blocks_per_request``)."""
    return blocks_for(min(window - 1 + in_flight, max_model_len), block_size) + 1


# ------------------------------------------------------------------------------------------ the engine
def hybrid_loaded():
    """(model, tokenizer) of the tiny hybrid model, loaded once per process (``load_shared``)."""
    from engine.model_loader import load_shared

    return load_shared(EMBEDDED_HYBRID_MODEL)


def _engine(loaded, **kwargs) -> LLMEngine:
    """A V1 engine on the hybrid model. Built directly, not from a ``RunSpec``: the lesson's own fixed,
    small run of a model the project ships (a class server's model allow-list is for what students pick)."""
    kwargs = {"semantics": "v1", "block_size": BLOCK_SIZE, "num_blocks": NUM_BLOCKS, "max_num_seqs": 4, **kwargs}
    return LLMEngine(EngineConfig(model=EMBEDDED_HYBRID_MODEL, **kwargs), loaded=loaded)


def _tokenize(loaded):
    return lambda text: loaded[1](text, add_special_tokens=False)["input_ids"]


@dataclass
class StepView:
    """One step of the window run, read from its step record: tokens computed before the step (what the
    window frees by), tokens held after it, every group's table after it (``SequenceState.group_block_tables``,
    ``NULL_BLOCK`` where a block left the window), the blocks each sliding group gave back in this step
    (``leave_window`` events) and the step's ``engine.metrics.hybrid_saving`` (blocks saved, held, twin)."""

    step: int
    computed_before: int
    num_tokens: int
    tables: list[list[int]]
    left_window: dict[int, list[int]]
    words: list[str]
    saving: dict

    @property
    def held(self) -> int:
        return sum(b != NULL_BLOCK for t in self.tables for b in t)


@dataclass
class WindowRun:
    windows: list[int | None]   # each group's window (None: full attention)
    layers: list[tuple[int, ...]]
    prompt_len: int
    steps: list[StepView] = field(default_factory=list)

    def twin(self, view: StepView) -> int:
        """Blocks the all-full-attention twin holds: every group's table, whole."""
        return len(self.windows) * blocks_for(view.num_tokens, BLOCK_SIZE)

    def saved(self, view: StepView) -> int:
        return hybrid_blocks_saved(view.computed_before, BLOCK_SIZE, self.windows)


@lru_cache(maxsize=1)  # deterministic: the same run for every caller (the app's memo keeps it across sessions too)
def window_run() -> WindowRun:
    """The hybrid model on one request decoding past its window (see the module docstring)."""
    loaded = hybrid_loaded()
    prompt = exact_prompt(_tokenize(loaded), PRESSURE_LONG_TEXT * 8, PROMPT_LEN)
    e = _engine(loaded, max_num_batched_tokens=BUDGET, enable_prefix_caching=True)
    rid = e.add_request(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    run = None
    while e.has_unfinished():
        rec = e.step()
        snap = rec.snapshot
        if run is None:
            groups = snap.kv_cache_groups
            run = WindowRun([g["sliding_window"] for g in groups], [tuple(g["layers"]) for g in groups], len(prompt))
        state = next((s for s in snap.sequences if s.request_id == rid and s.status == "running"), None)
        if state is None:  # finished: its blocks are back in the pool
            break
        before = next(x.start_pos for x in rec.scheduled if x.seq_id == state.seq_id)  # computed before the step
        left = {ev.data["group"]: list(ev.blocks) for ev in rec.events if ev.kind == "leave_window"}
        words = [ev.message for ev in rec.events if ev.kind == "leave_window"]
        run.steps.append(StepView(rec.step, before, state.num_tokens, [list(t) for t in state.group_block_tables],
                                  left, words, hybrid_saving(snap)))
    return run


@dataclass
class Lookup:
    """One request of the prefix run: every group's own hit (blocks, ``NULL_BLOCK`` where the group needs
    none) asked of its manager before the admission, and the hit the engine took (tokens)."""

    name: str
    prompt_len: int
    group_hits: list[list[int]]
    cached_tokens: int


@dataclass
class PrefixRun:
    windows: list[int | None]
    a_sliding_cached: list[int]   # logical blocks of A's prompt the sliding group left in the cache
    lookups: dict[str, Lookup]


@lru_cache(maxsize=1)
def prefix_run() -> PrefixRun:
    """A, then B and C sharing A's first ``SHARED`` tokens, one after another (see the module docstring)."""
    loaded = hybrid_loaded()
    tok = _tokenize(loaded)
    a = exact_prompt(tok, PRESSURE_LONG_TEXT * 8, PROMPT_LEN)
    prompts = {"A": a, "B": a[:SHARED] + exact_prompt(tok, LIFE_TEXT * 3, OWN),
               "C": a[:SHARED] + exact_prompt(tok, PRESSURE_TEXTS[1] * 6, OWN)}
    e = _engine(loaded, max_num_batched_tokens=256, enable_prefix_caching=True)
    managers = e.block_manager.managers
    pool = managers[0].pool
    lookups, a_cached = {}, []
    for name, prompt in prompts.items():
        hashes = list(prefix_hashes(prompt, BLOCK_SIZE, (len(prompt) - 1) // BLOCK_SIZE))
        hits = [list(m.find_longest_cache_hit(hashes)) for m in managers]
        rid = e.add_request(prompt, SamplingParams(max_tokens=PREFIX_OUT, temperature=0.0, ignore_eos=True))
        while e.has_unfinished():
            e.step()
        lookups[name] = Lookup(name, len(prompt), hits, e.get_output(rid).num_cached_tokens)
        if name == "A":
            a_hashes = list(prefix_hashes(prompt, BLOCK_SIZE, len(prompt) // BLOCK_SIZE))
            g = next(i for i, m in enumerate(managers) if m.sliding_window is not None)
            a_cached = [i for i, h in enumerate(a_hashes) if pool.get_cached_block(h, g) is not None]
    return PrefixRun([m.sliding_window for m in managers], a_cached, lookups)


def hit_tokens(blocks: list[int]) -> int:
    return len(blocks) * BLOCK_SIZE


# ------------------------------------------------------------------------------------------ real configs
def preset(key: str) -> kv_math.ModelPreset:
    return kv_math.model_presets(include_hybrid=True)[key]


def gpu_bytes() -> int:
    return GPU_GB * kv_math.GB


def fits(key: str, utilization: float = kv_math.VLLM_GPU_MEMORY_UTILIZATION,
         weights: int | None = None) -> dict[int, kv_math.HybridFit]:
    p = preset(key)
    w = kv_math.weight_bytes(p) if weights is None else weights
    return {L: kv_math.hybrid_fit(gpu_bytes(), w, p.config, p.dtype, L, BLOCK_SIZE, utilization) for L in CONTEXTS}


def config_rows(key: str) -> list[dict]:
    """The config.json fields the arithmetic reads, as copied into lessons/data/models."""
    p = preset(key)
    c = p.config
    windows = [w for w in _layer_windows(c)]
    sliding = [i for i, w in enumerate(windows) if w is not None]
    return [{"field": "num_hidden_layers", "value": f"{c.num_hidden_layers}"},
            {"field": "num_key_value_heads", "value": f"{c.num_key_value_heads}"},
            {"field": "head_dim", "value": f"{c.head_dim}"},
            {"field": "sliding_window", "value": f"{c.sliding_window:,}"},
            {"field": "layer_types", "value": f"{len(sliding)} sliding_attention, {len(windows) - len(sliding)} "
                                              f"full_attention ({_pattern(windows)})"},
            {"field": "torch_dtype (the KV cache's dtype)", "value": p.dtype}]


def _layer_windows(config) -> list[int | None]:
    from engine.kv_cache import layer_windows

    return layer_windows(config)


def _pattern(windows: list[int | None]) -> str:
    full = [i for i, w in enumerate(windows) if w is None]
    if len(full) > 1:
        return f"full at layers {full[0]}, {full[1]}, ... every {full[1] - full[0]}"
    return f"full at layer {full[0]}" if full else "none full"


def group_rows(key: str) -> list[dict]:
    p = preset(key)
    return [{"KV cache group": i, "kind": c.kind, "layers": len(c.layers),
             "bytes per token": f"{c.bytes_per_token:,} ({kv_math.human_bytes(c.bytes_per_token)})"}
            for i, c in enumerate(kv_math.group_costs(p.config, p.dtype))]


def fit_rows(key: str) -> list[dict]:
    rows = []
    for L, f in fits(key).items():
        rows.append({"tokens per request": f"{L:,}", "blocks per request (hybrid)": f"{f.blocks_per_request:,}",
                     "blocks per request (all-full twin)": f"{f.twin_blocks_per_request:,}",
                     "requests that fit (hybrid)": f.requests, "requests that fit (twin)": f.twin_requests})
    return rows


def _k(L: int) -> str:
    return f"{L // 1024}k"


# ------------------------------------------------------------------------------------------ the lesson
def _free_step(run: WindowRun) -> int:
    """Index (into ``run.steps``) of the first step where a sliding group gives back more than one block."""
    return next(i for i, v in enumerate(run.steps) if any(len(b) > 1 for b in v.left_window.values()))


def _saved_step(run: WindowRun) -> int:
    """Index of the question's decode step: the last step while the request still runs."""
    return len(run.steps) - 1


def _reused(view: StepView, group: int) -> int | None:
    """A block of ``group``'s table at ``view`` that the same group gave back at that step (the pool handed it
    out again at once), if any."""
    again = [b for b in view.left_window.get(group, []) if b in view.tables[group]]
    return again[0] if again else None


def _table_text(table: list[int]) -> str:
    return "[" + ", ".join("null" if b == NULL_BLOCK else str(b) for b in table) + "]"


def _sliding(run) -> int:
    return next(i for i, w in enumerate(run.windows) if w is not None)


def _full(run) -> int:
    return next(i for i, w in enumerate(run.windows) if w is None)


def facts(ctx) -> dict:
    run = ctx.memo(window_run)
    pr = ctx.memo(prefix_run)
    s, f = _sliding(run), _full(run)
    W = run.windows[s]
    fi = _free_step(run)
    prev, at = run.steps[fi - 1], run.steps[fi]
    si = _saved_step(run)
    worked = preset(WORKED)
    wf = fits(WORKED)
    wg = kv_math.group_costs(worked.config, worked.dtype)
    wc = worked.config
    w_weights = kv_math.weight_bytes(worked)
    t = preset(TRANSFER)
    # vLLM's start-up budget for gpt-oss's sliding group at 32k: vllm serve's default async scheduling keeps
    # VLLM_ASYNC_BATCHES batches of its token budget in flight; without it, one
    L = CONTEXTS[1]
    in_flight = VLLM_ASYNC_BATCHES * VLLM_SERVE_BUDGET
    adm = admission_blocks(wc.sliding_window, in_flight, L)
    adm_sync = admission_blocks(wc.sliding_window, VLLM_SYNC_BATCHES * VLLM_SERVE_BUDGET, L)
    full_blocks = blocks_for(L, BLOCK_SIZE)
    fit32 = wf[L]
    example_c = EXAMPLE_C  # the intro's worked case; not a question's (the questions ask other steps)
    return {
        "block_size": BLOCK_SIZE, "window": W, "num_layers": sum(len(x) for x in run.layers),
        "sw_layers": " and ".join(map(str, run.layers[s])), "full_layers": " and ".join(map(str, run.layers[f])),
        "num_blocks": NUM_BLOCKS, "last_block": NUM_BLOCKS - 1, "prompt_len": run.prompt_len, "max_tokens": MAX_TOKENS, "budget": BUDGET,
        "example_c": example_c, "example_skip": blocks_left_window(example_c, BLOCK_SIZE, W),
        "steady_blocks": -(-W // BLOCK_SIZE) + 1,
        "saved_step": run.steps[si].step,
        "free_prev_step": prev.step, "free_step": at.step, "free_c": at.computed_before,
        "free_sliding_table": _table_text(prev.tables[s]), "free_full_table": _table_text(prev.tables[f]),
        "free_new": at.num_tokens - at.computed_before,
        "a_len": pr.lookups["A"].prompt_len, "shared": SHARED, "own": OWN,
        "a_sw_cached": ", ".join(map(str, pr.a_sliding_cached)) or "none",
        "hit_blocks_needed": blocks_for(W - 1, BLOCK_SIZE),
        "worked": worked.name, "worked_url": worked.source, "worked_fields": _md_table(config_rows(WORKED)),
        "worked_groups": _md_table(group_rows(WORKED)), "worked_fits": _md_table(fit_rows(WORKED)),
        "worked_ngroups": len(wg), "worked_group_layers": len(wg[0].layers),
        "worked_weights": f"{w_weights:,} bytes, {w_weights / kv_math.GIB:.1f} GiB", "gpu_gb": GPU_GB,
        "worked_blocks_sum": f"⌊({fit32.kv_bytes + w_weights:,} − {w_weights:,}) / {fit32.page_bytes:,}⌋ = "
                             f"**{fit32.num_blocks:,}** blocks",
        "util": f"{kv_math.VLLM_GPU_MEMORY_UTILIZATION:g}",
        "worked_page": kv_math.human_bytes(fit32.page_bytes), "worked_num_blocks": f"{fit32.num_blocks:,}",
        "worked_w": f"{wc.sliding_window:,}",
        "ratio_long": f"{wf[CONTEXTS[-1]].requests / max(wf[CONTEXTS[-1]].twin_requests, 1):.2f}",
        "ratio_short": f"{wf[CONTEXTS[0]].requests / max(wf[CONTEXTS[0]].twin_requests, 1):.2f}",
        "long_k": _k(CONTEXTS[-1]), "short_k": _k(CONTEXTS[0]),
        "adm_blocks": f"{adm:,}", "adm_len": _k(L), "adm_full": f"{full_blocks:,}",
        "adm_budget": f"{VLLM_SERVE_BUDGET:,}", "adm_batches": VLLM_ASYNC_BATCHES, "adm_in_flight": f"{in_flight:,}",
        "adm_concurrency": f"{fit32.num_blocks / (full_blocks + adm):.1f}",
        "adm_sync_blocks": f"{adm_sync:,}", "adm_sync_concurrency": f"{fit32.num_blocks / (full_blocks + adm_sync):.1f}",
        "adm_steady": fit32.requests,
        "transfer": t.name, "transfer_url": t.source, "transfer_fields": _md_table(config_rows(TRANSFER)),
        "contexts": ", ".join(_k(x) for x in CONTEXTS),
        "sources": "\n".join(f"- {fact}: `{path}`, `{fn}`" for fact, path, fn in VLLM_SOURCES),
    }


def _md_table(rows: list[dict]) -> str:
    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    lines += ["| " + " | ".join(str(r[h]) for h in head) + " |" for r in rows]
    return "\n".join(lines)


RECAP = [
    "A sliding-window layer reads only the last W tokens, so a block wholly before the window of the next "
    "token is given back: after c computed tokens, the first ⌊(c − W + 1) / B⌋ blocks of that group's table "
    "are the null block, and the group's KV per request stops growing.",
    "vLLM groups the layers by the kind of KV they keep, into groups with as many layers each; all groups "
    "draw blocks of one page size from one pool, and a request has one block table per group.",
    "A sliding group's prefix hit needs only the last ⌈(W − 1) / B⌉ blocks before the hit point, searched "
    "from the right; the coordinator takes the longest length every group accepts, so a prefix that only "
    "the full-attention group holds can give no hit at all.",
    "On an {{ gpu_gb }} GB GPU {{ worked }} fits {{ ratio_long }} times as many {{ long_k }}-token requests as "
    "its all-full-attention twin: half its layers stop growing at the window. vLLM's start-up estimate is "
    "lower, as it budgets a sliding group for the prompt chunks in flight (two steps' budget with vllm "
    "serve's default async scheduling).",
]


def exercises(ctx) -> dict[str, Exercise]:
    run = ctx.memo(window_run)
    pr = ctx.memo(prefix_run)
    s, f = _sliding(run), _full(run)
    W, B = run.windows[s], BLOCK_SIZE

    # 1. the window run: how many blocks fewer than the all-full twin, at the last decode step
    v = run.steps[_saved_step(run)]
    c = v.computed_before
    saved = run.saved(v)
    held, twin = v.held, run.twin(v)
    sliding_layers = len(run.layers[s])
    p_saved = Exercise(
        "p_saved",
        f"Step {v.step}: the request has computed **{c} tokens** (its {run.prompt_len}-token prompt and "
        f"{c - run.prompt_len} generated), and this step computes token {c}, its next. Before it takes a block "
        f"for that token, the sliding group gives back every block its window of {W} tokens has wholly left"
        + (" (at this step none has just left, so it gives back nothing new: the blocks that left earlier are "
           "already null)" if not v.left_window.get(s) else "")
        + ". After the step, **how many blocks fewer** than its all-full-attention twin does the request hold, "
        "both groups together?",
        "number", saved, unit="blocks",
        slips=[Slip("nothing-before-the-end", 0, "A window frees blocks while the request runs, not when it "
                    "ends: every block wholly before the window of the next token goes back at once."),
               Slip("round-up", -(-(c - W + 1) // B), f"That counts the block where the window starts too; a "
                    f"block goes back only when **every** token in it is before the window: "
                    f"⌊({c} − {W} + 1) / {B}⌋."),
               Slip("held", held, "That is what the request holds after the step; the question asks how "
                    "many fewer than its twin."
                    + (f" (Or the saving counted per layer: one block of the sliding group holds the K and V "
                       f"of all {sliding_layers} of its layers.)" if saved * sliding_layers == held else "")),
               Slip("twin", twin, "That is what the twin holds; the question asks for the difference.")]
        + ([Slip("per-layer", saved * sliding_layers, f"That counts per layer. One block of the sliding group "
                 f"holds the K and V of all {sliding_layers} of its layers "
                 f"({', '.join(map(str, run.layers[s]))}), so it gives back one block per block of tokens.")]
           if saved * sliding_layers not in (held, twin) else []),
        explanation=(f"Tokens 0 to {c - W} are before the window of token {c} (it reads {c - W + 1} .. {c}), "
                     f"so ⌊({c} − {W} + 1) / {B}⌋ = **{saved}** blocks of the sliding group are the null block "
                     f"(`engine.metrics.hybrid_blocks_saved`). The request holds {held} blocks; its twin would "
                     f"hold {len(run.windows)} × ⌈{v.num_tokens} / {B}⌉ = {twin}."))

    # 2. act as the sliding group: which blocks go back at the chunk step
    fi = _free_step(run)
    prev, at = run.steps[fi - 1], run.steps[fi]
    freed = at.left_window[s]
    table = prev.tables[s]
    n_skip = blocks_left_window(at.computed_before, B, W)
    logical = [i for i in range(n_skip) if table[i] != NULL_BLOCK]
    partial = [table[i] for i in range(min(-(-(at.computed_before - W + 1) // B), len(table)))
               if table[i] != NULL_BLOCK]
    a_free = Exercise(
        "a_free",
        f"You are the sliding group's manager. After step {prev.step} the request has computed "
        f"{at.computed_before} tokens; its table in the sliding group is `{_table_text(table)}` and in the "
        f"full group `{_table_text(prev.tables[f])}` (physical block ids, logical block 0 first"
        + (f"; block {_reused(prev, s)} went back at an earlier step and the pool handed it "
           "out again" if _reused(prev, s) is not None else "") + f"). Step "
        f"{at.step} schedules its next {at.num_tokens - at.computed_before} prompt tokens. Before taking new "
        "blocks, you give back what the window has left. **Which physical blocks do you give back?**",
        "set", freed, tags={"allocator"}, pool_blocks=NUM_BLOCKS,
        slips=[Slip("logical-index", logical, "Those are the **logical** positions in the table; give the "
                    "physical block ids they hold."),
               Slip("partly-in-window", partial, f"That gives back the block where the window of token "
                    f"{at.computed_before} starts; some of its tokens are still read "
                    f"({at.computed_before - W + 1} onwards), so it stays."),
               Slip("full-group-too", sorted(set(freed) | {b for b in prev.tables[f][:n_skip]}),
                    "The full-attention group keeps every block: its layers read every earlier token.")],
        explanation=(f"Token {at.computed_before} reads tokens {at.computed_before - W + 1} .. "
                     f"{at.computed_before}, so logical blocks 0 .. {n_skip - 1} hold nothing anyone reads again; "
                     f"those still held go back, walked from the window's edge backwards ({freed}), and their "
                     f"entries become the null block. " + " ".join(f"*{w}*" for w in at.words)))

    # 3. act as the coordinator: B's hit when only the full group has the prefix
    lb, lc = pr.lookups["B"], pr.lookups["C"]
    full_b = hit_tokens(lb.group_hits[f])
    need = blocks_for(W - 1, B)
    a_hit = Exercise(
        "a_hit",
        f"A's {pr.lookups['A'].prompt_len}-token prompt ran and finished; its blocks sit free in the cache. "
        f"In the full group every full block of A's prompt is cached; the sliding group cached only A's "
        f"logical blocks {', '.join(map(str, pr.a_sliding_cached))} (the ones a resend of A's prompt would "
        f"need at its end). Now B arrives: A's first {SHARED} tokens, then {OWN} of its own. You are the "
        "coordinator: **how many of B's prompt tokens does the prefix cache find?**",
        "number", lb.cached_tokens, unit="tokens", tags={"allocator"},
        slips=[Slip("full-group-alone", full_b, f"That is the full group's hit ({full_b // B} blocks from the "
                    "left). The sliding group must accept the same length, and for a hit ending there it needs "
                    f"its last {need} blocks before that point cached."),
               Slip("window-only", need * B, f"That is the sliding group's {need} blocks of need, counted as a "
                    "hit; but none of them is cached, and a hit needs every group's blocks."),
               Slip("shared-tokens", SHARED, f"Hits come in whole blocks: at most ⌊{SHARED} / {B}⌋ × {B} "
                    "tokens, and only if every group has them.")],
        explanation=(f"The full group found {full_b} tokens. The sliding group, searched from the right within "
                     f"those {full_b // B} blocks, found no run of {need} cached blocks (A's cached ones, logical "
                     f"{', '.join(map(str, pr.a_sliding_cached))}, lie beyond them) and no cached block from the "
                     f"start: {hit_tokens(lb.group_hits[s])} tokens. A hit must hold for every group, so the "
                     f"engine found **{lb.cached_tokens}**, and B computed its whole prompt."))

    # 4. transfer: C after B
    t_again = Exercise(
        "t_again",
        f"B finished too. Then C arrives: the same first {SHARED} tokens, then {OWN} of its own, different "
        "from B's. **How many of C's prompt tokens does the prefix cache find?**",
        "number", lc.cached_tokens, unit="tokens", tags={"transfer"},
        slips=[Slip("same-as-b", lb.cached_tokens, "Not the same as B: when B found a prefix the full group "
                    "shared but the sliding group did not hold, vLLM cached B's sliding blocks before that point "
                    "(a prefix other requests share is a place a later hit can end)."),
               Slip("shared-tokens", SHARED, f"Hits come in whole blocks of {B}."),
               Slip("window-only", need * B, "Every group found the whole shared prefix this time, and a hit is "
                    "as long as the prefix every group accepts, not just the window's blocks.")],
        explanation=(f"Full group: {hit_tokens(lc.group_hits[f])} tokens; sliding group: "
                     f"{hit_tokens(lc.group_hits[s])} tokens, its last {need} blocks before the hit point now "
                     f"cached by B's run. C found **{lc.cached_tokens}**."))

    # 5. real config: gpt-oss-20b's bytes per token in one group
    worked = preset(WORKED)
    wg = kv_math.group_costs(worked.config, worked.dtype)
    g0 = next(g for g in wg if g.sliding_window is not None)
    wc = worked.config
    geo = kv_math.geometry(wc, worked.dtype)
    kib = g0.bytes_per_token / 1024
    r_bytes = Exercise(
        "r_bytes",
        f"**{worked.name}** (its config.json fields are listed in the lesson's section on real models): {wc.num_hidden_layers} layers, half of them "
        f"sliding-window layers ({wc.sliding_window} tokens), {wc.num_key_value_heads} KV heads of head_dim "
        f"{wc.head_dim}, the KV cache in {worked.dtype}. vLLM puts the sliding layers in one group and the full "
        "ones in another. **How many KiB does one token take in the sliding group?**",
        "number", kib, unit="KiB",
        slips=[Slip("every-layer", geo.bytes_per_token / 1024, "That is every layer's K and V: both groups "
                    "together (the all-full twin's bytes per token). One group holds only its own layers."),
               Slip("k-only", kib / 2, "That counts K only; every layer keeps a V vector per KV head too."),
               Slip("one-layer", kib / len(g0.layers), f"That is one layer; the group has {len(g0.layers)}.")],
        explanation=(f"2 × {len(g0.layers)} layers × {geo.num_kv_heads} KV heads × {geo.head_dim} × "
                     f"{geo.dtype_bytes} bytes = {g0.bytes_per_token:,} bytes = **{kib:g} KiB**, and as much in "
                     "the full group: every group has as many layers, so their blocks are the same size."))

    # 6. transfer: Gemma 3 12B at 32k
    t = preset(TRANSFER)
    tf = fits(TRANSFER)[TRANSFER_CONTEXT]
    tg = kv_math.group_costs(t.config, t.dtype)
    nfull = sum(g.sliding_window is None for g in tg)
    full_only = tf.num_blocks // (nfull * blocks_for(TRANSFER_CONTEXT, B))
    no_weights = fits(TRANSFER, weights=0)[TRANSFER_CONTEXT].requests
    t_gemma = Exercise(
        "t_gemma",
        f"**{t.name}** (its config.json fields are listed in the lesson's section on real models). Same GPU, "
        f"same convention (80 × 10^9 bytes × {kv_math.VLLM_GPU_MEMORY_UTILIZATION:g}, minus "
        f"{kv_math.weight_bytes(t):,} bytes ({kv_math.weight_bytes(t) / kv_math.GIB:.1f} GiB) of {t.dtype} "
        f"weights), blocks of {B}. **How many "
        f"requests of {TRANSFER_CONTEXT:,} tokens fit at once?**",
        "number", tf.requests, unit="requests", tags={"transfer"},
        slips=[Slip("twin", tf.twin_requests, "That is the all-full-attention twin: every layer keeping all "
                    f"{TRANSFER_CONTEXT:,} tokens."),
               Slip("full-only", full_only, "That counts only the full-attention group: the sliding groups "
                    f"still hold their last window, about {-(-t.config.sliding_window // B) + 1} blocks each "
                    "per request."),
               Slip("no-weights", no_weights, "That gives the whole budget to the KV cache; the weights "
                    "come out of it first.")],
        explanation=(f"{len(tg)} groups of {len(tg[0].layers)} layers ({len(tg) - nfull} sliding, {nfull} full), "
                     f"one block = {kv_math.human_bytes(tf.page_bytes)}, {tf.num_blocks:,} blocks. A "
                     f"{TRANSFER_CONTEXT:,}-token request holds {tf.blocks_per_request:,} blocks (its twin "
                     f"{tf.twin_blocks_per_request:,}): **{tf.requests}** fit, against {tf.twin_requests} for the "
                     "twin."))
    return {"p_saved": p_saved, "a_free": a_free, "a_hit": a_hit, "t_again": t_again, "r_bytes": r_bytes,
            "t_gemma": t_gemma}


# ------------------------------------------------------------------------------------------ drawings
def _df(rows):
    import pandas as pd
    import streamlit as st

    st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")


def _tables_rows(run: WindowRun, view: StepView) -> list[dict]:
    rows = []
    for g, table in enumerate(view.tables):
        w = run.windows[g]
        rows.append({"KV cache group": f"{g}: layers {', '.join(map(str, run.layers[g]))}, "
                                       + ("full attention" if w is None else f"window {w}"),
                     "block table (null: gave its block back)": _table_text(table),
                     "blocks held": sum(b != NULL_BLOCK for b in table),
                     "twin holds": blocks_for(view.num_tokens, BLOCK_SIZE),
                     "this step gave back": ", ".join(map(str, view.left_window.get(g, []))) or "-"})
    return rows


def tables_markdown(run: WindowRun, view: StepView) -> None:
    """Every group's block table at ``view`` as a Markdown table: its cells wrap, so a long table is shown
    whole at any page width (a dataframe cut the sliding group's table at 1280 px)."""
    import streamlit as st

    st.markdown(_md_table(_tables_rows(run, view)))


def reveal_p_saved(ctx) -> None:
    import streamlit as st

    run = ctx.memo(window_run)
    v = run.steps[_saved_step(run)]
    tables_markdown(run, v)
    st.caption(f"After step {v.step} (vLLM V1 semantics, the tiny hybrid model): {v.held} blocks held, "
               f"{run.twin(v)} for the all-full-attention twin, {run.saved(v)} saved.")


def reveal_a_free(ctx) -> None:
    import streamlit as st

    run = ctx.memo(window_run)
    at = run.steps[_free_step(run)]
    tables_markdown(run, at)
    st.caption(f"After step {at.step}. The blocks given back went to the front of the free queue (they carry "
               "no hash), so the same step's new blocks may be those very blocks again.")


def reveal_a_hit(ctx) -> None:
    pr = ctx.memo(prefix_run)
    _df(_lookup_rows(pr, "B"))


def reveal_t_again(ctx) -> None:
    pr = ctx.memo(prefix_run)
    _df(_lookup_rows(pr, "C"))


def _lookup_rows(pr: PrefixRun, name: str) -> list[dict]:
    lk = pr.lookups[name]
    rows = []
    for g, hit in enumerate(lk.group_hits):
        w = pr.windows[g]
        rows.append({"KV cache group": "full attention" if w is None else f"sliding window {w}",
                     "its own hit (blocks; null: not needed)": _table_text(hit) if hit else "none",
                     "tokens it accepts": hit_tokens(hit)})
    rows.append({"KV cache group": "the coordinator: what every group accepts",
                 "its own hit (blocks; null: not needed)": "", "tokens it accepts": lk.cached_tokens})
    return rows


def reveal_t_gemma(ctx) -> None:
    import streamlit as st

    st.markdown(_md_table(group_rows(TRANSFER)))  # Markdown tables wrap at 1280 px; a dataframe cut a column
    st.markdown(_md_table(fit_rows(TRANSFER)))
    st.caption(f"{GPU_GB} × 10^9 bytes × {kv_math.VLLM_GPU_MEMORY_UTILIZATION:g} − weights, in blocks of "
               f"{BLOCK_SIZE} tokens; each request holding that many tokens, all computed.")


def widget_run(ctx) -> None:
    import streamlit as st

    from lessons.render import keep

    run = ctx.memo(window_run)
    with st.container(border=True):
        n = len(run.steps)
        keep(keep_l10_step=min(n, _free_step(run) + 1))  # the first value; then the slider's own (no value=)
        i = st.slider("Step", 1, n, key="keep_l10_step") - 1
        v = run.steps[i]
        st.caption(f"step {v.step}: {v.computed_before} tokens computed before it, {v.num_tokens} tokens held after "
                   "it · "
                   f"{v.saving['held']} blocks held, the all-full twin {v.saving['twin']}, saved "
                   f"{v.saving['blocks']} (engine.metrics.hybrid_saving, as the Playground shows it)")
        tables_markdown(run, v)
        for w in v.words:
            st.markdown(f"- {w}")


if __name__ == "__main__":
    from lessons.render import render_lesson

    render_lesson(__file__)

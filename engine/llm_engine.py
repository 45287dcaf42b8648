"""``LLMEngine``: the public entry point (names follow vLLM's).

    engine = LLMEngine(EngineConfig(block_size=16, num_blocks=64))
    rid = engine.add_request("ROMEO. ", SamplingParams(max_tokens=20, temperature=0))
    while engine.has_unfinished():
        record = engine.step()          # one prefill or decode step -> StepRecord
    print(engine.get_output(rid).output_text)

One step: the scheduler picks a batch (the block manager allocates, appends, copies, frees), pending
copy-on-write copies are applied to the KV tensors, the model runner computes the batch's tokens with K/V
in the paged pool, each request samples its next token, finished requests free their blocks, and a
``StepRecord`` describes all of it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import numbers
import random
import time
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter

import torch

import kernels

from . import limits, memory
from .allocator import KVAllocator
from .block_manager import BlockManager
from .contiguous import ContiguousAllocator
from .config import DEFAULT_MAX_NUM_BATCHED_TOKENS_V1, MAX_SEED, EngineConfig, SamplingParams
from .kv_cache import KVCache, num_blocks_for_budget
from .model_loader import geometry_from_config, load_model, resolve_device, resolve_dtype
from .model_runner import ModelRunner, SeqInput
from .records import EventLog, ScheduledSequence, SequenceState, Snapshot, StepRecord, make_snapshot
from .sampler import sample_batch
from .scheduler import Scheduler
from .scheduler_v1 import SchedulerV1
from .sequence import FINISHED, RUNNING, BeamState, CompletionOutput, Request, RequestOutput, Sequence

BEAM_NEG = -1.0e9  # transformers' "impossible" beam score

DEFAULT_POOL_REQUESTS = 4  # with neither num_blocks nor a budget, the pool holds 4 x max_model_len tokens
# A step's record keeps only the blocks the step changed, but a step a view draws builds its full per-block
# lists (count, fill, owners, hash): 5.5 MB a step at 65,536 blocks (tracemalloc, CPython 3.11), so a
# 3-million-block pool, when every step was built, kept ~250 MB a step until the process was killed. A
# larger pool is refused; the same memory at a larger block size is allowed.
MAX_RECORDED_BLOCKS = 65_536


def _shown(text: str, limit: int = 60) -> str:
    """``repr(text)``, cut to about ``limit`` characters (an error names a long prompt without holding it)."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text):,} characters)"


# pre-tokenizers that keep every character of the text (ByteLevel maps each byte to one character)
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"}


def _keeps_characters(spec: dict | None) -> bool:
    """Whether a ``tokenizers`` pre-tokenizer (its JSON ``spec``) keeps every character of the text, so the
    tokens cover the whole (normalized) text; a Split that removes its matches does not."""
    if spec is None:
        return True
    if spec.get("type") == "Sequence":
        return all(_keeps_characters(p) for p in spec.get("pretokenizers", []))
    if spec.get("type") == "Split":
        return str(spec.get("behavior", "")).lower() != "removed"
    return spec.get("type") in _KEEPING_PRE_TOKENIZERS


@dataclass
class _BeamCandidates:
    """One beam-search step's 2w candidates (best first): accumulated ``scores``, the live beam each
    continues (``parents``), its ``tokens``, whether it ``stops``, ``running_scores`` (stopped ones pushed
    down), the indices of the w that ``keep`` running and the beams' new ``length``."""

    scores: torch.Tensor
    parents: list[int]
    tokens: list[int]
    stops: torch.Tensor
    running_scores: torch.Tensor
    keep: list[int]
    length: int


class _StepOutput:
    """What one step produced, keyed by sequence id."""

    def __init__(self) -> None:
        self.tokens: dict[str, int] = {}
        self.text: dict[str, str] = {}
        self.finished: list[str] = []


class LLMEngine:
    """A paged-KV serving engine around one transformers model.

    Raises (constructor):
        ValueError: a config value that cannot work here (unknown device, a budget below one block,
            max_model_len above the model's or the pool's limit), naming the value.
        engine.model_loader.ModelLoadError (a ValueError): the model cannot be found or is unsupported.
    """

    def __init__(self, config: EngineConfig | None = None, loaded: tuple | None = None) -> None:
        """``loaded``: an already loaded ``(model, tokenizer)`` for ``config.model`` on the config's device
        and dtype (from ``engine.model_loader.load_model``), shared read-only between engines (the app
        keeps one copy of the weights for all sessions)."""
        config = config or EngineConfig()
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.backend = kernels.resolve_backend(config.attention_backend, self.device)
        self.model, self.tokenizer = loaded or load_model(config.model, self.device, self.dtype)
        self.geometry = geometry_from_config(self.model.config, self.dtype)
        self.block_size = config.block_size

        model_max = self.model.config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_max:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's max_position_embeddings {model_max}"
            )
        self.num_blocks = self._pool_blocks(config, model_max)
        if self.num_blocks > MAX_RECORDED_BLOCKS:
            raise ValueError(f"a pool of {self.num_blocks:,} blocks is more than the {MAX_RECORDED_BLOCKS:,} the engine "
                             f"can record step by step (a step drawn lists every block); use a larger "
                             f"block_size than {self.block_size} for the same memory, or a smaller pool")
        capacity = self.num_blocks * self.block_size
        if config.max_model_len is not None and config.max_model_len > capacity:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the pool's {capacity} token slots "
                f"({self.num_blocks} blocks x {self.block_size}); one request could never finish"
            )
        self.max_model_len = config.max_model_len or min(model_max, capacity)
        if self.block_size > self.max_model_len:
            raise ValueError(f"block_size {self.block_size} exceeds max_model_len {self.max_model_len}: one block "
                             f"would be longer than the longest sequence")
        self._check_memory(self.num_blocks * self.geometry.bytes_per_block(self.block_size),
                           self._swap_pool_blocks(config))
        if config.allocator == "contiguous" and config.contiguous_policy == "max":
            reservation = config.reservation_tokens or self.max_model_len
            if reservation > capacity:
                raise ValueError(f"reservation_tokens {reservation} is larger than the region of {capacity} slots "
                                 f"({self.num_blocks} blocks x {self.block_size}); no request could be admitted")
            self.max_model_len = min(self.max_model_len, reservation)  # a request stops at its reservation
        self.semantics = config.semantics
        if self.semantics == "v1":  # V1 prefills a longer prompt in chunks: any budget works
            max_batched = config.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS_V1
        else:
            max_batched = config.max_num_batched_tokens or max(self.max_model_len, 2048)
        self.max_num_batched_tokens = max_batched
        if self.semantics == "paper" and max_batched < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens {max_batched} is below max_model_len {self.max_model_len}; "
                f"a long request could never be prefilled"
            )

        self.log = EventLog()  # the engine's: allocator and scheduler write into it, each step drains it
        self.block_manager, self.kv_cache, self.runner = self._build_memory(config, self._swap_pool_blocks(config))
        if self.semantics == "v1":
            self.scheduler = SchedulerV1(self.block_manager, config.max_num_seqs, max_batched, self.max_model_len,
                                         policy=config.scheduling_policy,
                                         # vLLM counts its null block in the pool the watermark is a share of
                                         watermark_blocks=int(config.watermark * (self.num_blocks + 1)),
                                         log=self.log)
        else:
            self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, max_batched,
                                       config.preemption_mode, log=self.log)
        self.requests: dict[str, Request] = {}
        # the requests a snapshot lists: every unfinished one and those finished this step (in add order);
        # a finished request leaves it, so a step's cost does not grow with every request ever served
        self._listed: dict[str, Request] = {}
        # ``snapshot`` keeps each listed request's SequenceStates and rebuilds only those of requests that
        # may have changed since the last one (added, scheduled, running then or now), so a step's cost does
        # not grow with the waiting queue: a request waiting untouched is not visited
        self._states: dict[str, tuple[SequenceState, ...]] = {}
        self._touched: set[str] = set()  # added or scheduled since the last snapshot
        self._was_running: set[str] = set()  # running at the last snapshot (preempted since, maybe)
        self._leaving: set[str] = set()  # listed but finished: dropped once a later step is snapshotted
        self._roots: set[str] = set()  # "R1" for an id "R1.x" a request holds (``_auto_ids`` skips it)
        self._token_text: dict[int, str] = {}  # token id -> its text alone (StepRecord.new_text)
        self.parents: dict[str, list[str]] = {}  # V1: a request with n > 1 -> its child requests' ids
        self._arrivals = 0
        self.step_count = 0
        self._next_id = 1
        self.kv_event_publisher = None  # bound last: a config refused above never holds a port
        if config.kv_events_endpoint is not None:
            from .kv_publisher import KVEventPublisher  # pyzmq only when publishing
            self.kv_event_publisher = KVEventPublisher(config.kv_events_endpoint, config.kv_events_replay_endpoint,
                                                       topic=config.kv_events_topic,
                                                       data_parallel_rank=config.kv_events_data_parallel_rank)

    def close(self) -> None:
        """Release what outlives a step: the KV event publisher's sockets and thread (after sending what is
        queued). Idempotent; the engine's records stay readable."""
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.close()

    def _check_memory(self, nbytes: int, swap_blocks: int = 0) -> None:
        """Refuse a KV pool of ``nbytes`` bytes on the device, and a CPU swap pool of ``swap_blocks`` blocks,
        that the machine cannot hold, before either is allocated.

        Free memory is ``torch.cuda.mem_get_info`` on CUDA; on the host it is the smaller of the free RAM and
        what the container's cgroup limit allows (``engine.memory.available_host_memory_bytes``). The swap
        pool always lives in host memory, so with the pool on the CPU both must fit together.

        Raises:
            ValueError: the pool or the swap pool (naming ``swap_space_blocks``) does not fit, with the
                sizes in GiB.
        """
        gib = 2**30
        host = memory.available_host_memory_bytes()
        free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else host
        if free is not None and nbytes > free:
            raise ValueError(
                f"a KV pool of {self.num_blocks} blocks x {self.block_size} tokens needs {nbytes / gib:.2f} GiB "
                f"but only {free / gib:.2f} GiB are free on {self.device}; use fewer blocks or a smaller budget")
        swap_bytes = swap_blocks * self.geometry.bytes_per_block(self.block_size)
        pool_on_host = 0 if self.device.type == "cuda" else nbytes
        if host is not None and swap_bytes and pool_on_host + swap_bytes > host:
            also = f" besides the KV pool's {nbytes / gib:.2f} GiB" if pool_on_host else ""
            raise ValueError(
                f"swap_space_blocks {swap_blocks} needs {swap_bytes / gib:.2f} GiB of CPU memory for the swap pool"
                f"{also} but only {host / gib:.2f} GiB are free on the host; use a smaller swap_space_blocks")

    def _swap_pool_blocks(self, config: EngineConfig) -> int:
        """Blocks of the CPU swap pool that ``__init__`` allocates: ``swap_space_blocks``, or when None as many
        as the pool in "swap" mode and none in "recompute" mode; none for the contiguous allocator."""
        if config.allocator == "contiguous":
            return 0
        if config.swap_space_blocks is not None:
            return config.swap_space_blocks
        return self.num_blocks if config.preemption_mode == "swap" else 0

    def _build_memory(self, config: EngineConfig, swap_blocks: int) -> tuple[KVAllocator, KVCache, ModelRunner]:
        """The allocator, the KV tensors and the model runner: the one place that knows which allocator
        ``config.allocator`` names. Both hold the same bytes: the contiguous region is the pool's
        ``num_blocks x block_size`` slots as one flat range ("blocks" of one slot)."""
        dtype = next(self.model.parameters()).dtype
        if config.allocator == "contiguous":
            capacity = self.num_blocks * self.block_size
            allocator = ContiguousAllocator(capacity, config.reservation_tokens or self.max_model_len,
                                            config.contiguous_policy, event_log=self.log,
                                            max_model_len=self.max_model_len)
            kv_cache = KVCache(self.geometry, capacity, 1, self.device, dtype)
            return allocator, kv_cache, ModelRunner(self.model, kv_cache, self.backend, contiguous=True)
        allocator = BlockManager(self.num_blocks, self.block_size, enable_prefix_caching=config.enable_prefix_caching,
                                 num_swap_blocks=swap_blocks, watermark=config.watermark, event_log=self.log,
                                 evict_uncached_first=config.semantics == "v1")
        kv_cache = KVCache(self.geometry, self.num_blocks, self.block_size, self.device, dtype,
                           num_swap_blocks=swap_blocks)
        return allocator, kv_cache, ModelRunner(self.model, kv_cache, self.backend)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's ``LLMEngine.reset_prefix_cache``). Refused, returning False and
        changing nothing, while any request holds blocks; the next step's record carries the
        "reset_prefix_cache" event."""
        return self.block_manager.reset_prefix_cache()

    def _pool_blocks(self, config: EngineConfig, model_max: int) -> int:
        if config.num_blocks is not None:
            return config.num_blocks
        if config.kv_budget_bytes is not None:
            return num_blocks_for_budget(config.kv_budget_bytes, self.geometry, self.block_size)
        tokens = DEFAULT_POOL_REQUESTS * (config.max_model_len or model_max)
        return -(-tokens // self.block_size)

    # ------------------------------------------------------------------------------------------ requests
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, final_len: int | None = None, priority: int = 0) -> str:
        """Queue a request; returns its id ("R1", "R2", ... unless given).

        ``final_len``: its true final length (prompt + generated tokens) when known in advance, for the
        contiguous "pow2" and "oracle" policies (with ``ignore_eos`` it is known: prompt + max_tokens,
        capped at max_model_len); with n samples or beams, the longest its sequences reach (each reserves that
        much on the contiguous baseline: a shorter one makes a longer sample or beam stop at "length").
        ``priority``: V1's priority policy runs lower values first (vLLM's
        ``add_request(priority=...)``); ignored by FCFS. In V1 semantics a request with ``n > 1`` enters
        the scheduler as ``n`` child requests "<id>.0" .. "<id>.<n-1>" (vLLM's ``ParentRequest``) that
        share the prompt's full blocks through the prefix cache; ``get_output(id)`` gathers them.

        Raises:
            ValueError: ``params`` not a ``SamplingParams``, an empty prompt, a token id outside the
                vocabulary, a duplicate id, a prompt that can never fit in the pool or leaves no room to
                generate within max_model_len (vLLM's rule: prompt + at least one token; a prompt too long
                is refused by its length before any per-token work), n samples that can never run (see
                ``_make_request``; n above ``config.MAX_N_SEQUENCES`` is refused by ``SamplingParams``),
                more requests than a class server allows (V1's child requests count). The engine is
                unchanged.
        """
        params = self._check_params(params)
        # a class server's cap per engine (engine/limits.py); V1 adds n child requests at once
        limits.check_request_count(len(self.requests), params.n if self.semantics == "v1" else 1)
        rid = request_id if request_id is not None else self._auto_ids(1)[0]
        for request in self._make_requests(prompt, params, rid, final_len, priority):
            self._enqueue(request)
        return rid

    @staticmethod
    def _check_params(params) -> SamplingParams:
        """``params``, or the defaults for None; ValueError naming the type of anything else (a string, a
        dict: only ``SamplingParams`` has been validated)."""
        if params is None:
            return SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__} {repr(params)[:40]}")
        return params

    def _make_requests(self, prompt, params: SamplingParams, rid: str, final_len: int | None = None,
                       priority: int = 0) -> list[Request]:
        """The request, or in V1 semantics with ``n > 1`` its child requests (validated; nothing added)."""
        params = self._check_params(params)
        if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        priority = int(priority)
        if self.semantics != "v1":
            return [self._make_request(prompt, params, rid, final_len, priority)]
        if params.beam_width > 1:
            raise ValueError(f"beam_width {params.beam_width}: vLLM V1 runs beam search outside its scheduler "
                             f"(semantics='v1'); the paper's beam search needs semantics='paper'")
        if params.n == 1:
            return [self._make_request(prompt, params, rid, final_len, priority)]
        if rid in self.parents:
            raise ValueError(f"request_id {rid!r} is already in use")
        # each child must fit the pool on its own; together they just queue (vLLM refuses no n up to its
        # VLLM_MAX_N_SEQUENCES, which SamplingParams holds). Validated once, as the parent: the children
        # differ only in id and seed (vLLM's ParentRequest: seed + i)
        parent = self._make_request(prompt, dataclasses.replace(params, n=1), rid, final_len, priority)
        if parent.seed + params.n - 1 >= MAX_SEED:
            raise ValueError(f"seed {parent.seed} + {params.n - 1} (the last of n={params.n} samples' seeds) is not "
                             f"below 2**62")
        children = []
        for i in range(params.n):
            cid = f"{rid}.{i}"
            if cid in self.requests or cid in self.parents:
                raise ValueError(f"request_id {cid!r} is already in use")
            seed = parent.seed + i
            child_params = copy.copy(params)  # the parent's, validated; only n and the seed differ
            child_params.n, child_params.seed = 1, seed
            child = copy.copy(parent)
            child.request_id, child.params, child.seed, child.parent_id = cid, child_params, seed, rid
            child.seqs = [Sequence(cid, list(parent.prompt_token_ids), len(parent.prompt_token_ids),
                                   self._generator(seed, 0))]
            children.append(child)
        return children

    def check_request(self, prompt, params: SamplingParams | None = None, final_len: int | None = None,
                      priority: int = 0) -> list[int]:
        """Validate a request without adding it; returns its prompt token ids.

        Raises:
            ValueError: whatever ``add_request`` would refuse, with the same message.
        """
        # an id that is free now, so a caller's own ids never make the check fail
        return self._make_requests(prompt, params, self._auto_ids(1)[0], final_len, priority)[0].prompt_token_ids

    def _auto_ids(self, count: int) -> list[str]:
        """The next ``count`` free ids "R<k>", skipping ids a caller chose."""
        ids, k = [], self._next_id
        while len(ids) < count:
            if f"R{k}" not in self.requests and f"R{k}" not in self.parents and f"R{k}" not in self._roots:
                ids.append(f"R{k}")
            k += 1
        return ids

    def _enqueue(self, request: Request) -> None:
        # the child requests of one n > 1 request share its arrival (vLLM copies the request)
        if request.parent_id not in self.parents:  # a request of its own, or the first child
            self._arrivals += 1
        request.arrival = self._arrivals
        self.requests[request.request_id] = request
        self._listed[request.request_id] = request
        self._touched.add(request.request_id)
        if "." in request.request_id:  # "R1.0" takes "R1" for a parent's children (``_auto_ids``)
            self._roots.add(request.request_id.split(".")[0])
        if request.parent_id is not None:
            self.parents.setdefault(request.parent_id, []).append(request.request_id)
        self.scheduler.add(request)
        rid = request.request_id
        if rid.startswith("R") and rid[1:].isdigit():
            self._next_id = max(self._next_id, int(rid[1:]) + 1)

    def _make_request(self, prompt, params: SamplingParams, rid: str, final_len: int | None = None,
                      priority: int = 0) -> Request:
        """Validate and tokenize; raises ValueError and changes nothing on bad input."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request_id must be a non-empty string, got {rid!r}")
        if rid in self.requests or rid in self.parents:
            raise ValueError(f"request_id {rid!r} is already in use")
        text, ids = self._tokenize(prompt)
        if params.num_seqs > self.config.max_num_seqs:
            raise ValueError(f"{params.num_seqs} samples/beams exceed max_num_seqs {self.config.max_num_seqs}; "
                             f"they could never run together")
        per_request = self.block_manager.max_seqs_per_request
        if per_request is not None and params.num_seqs > per_request:
            raise ValueError(f"the {self.config.allocator} allocator serves {'one' if per_request == 1 else per_request}"
                             f" sequence{'s' * (per_request != 1)} per request; "
                             f"got n={params.n}, beam_width={params.beam_width}")
        self._check_prompt_len(len(ids))
        max_len = min(len(ids) + params.max_tokens, self.max_model_len)
        if final_len is None and params.length_known:
            final_len = max_len
        if final_len is not None and (isinstance(final_len, bool) or not isinstance(final_len, int)
                                      or not len(ids) < final_len <= max_len):
            raise ValueError(f"final_len {final_len!r} must be an integer in ({len(ids)}, {max_len}]: "
                             f"the prompt plus 1..max_tokens generated tokens")
        reservation = self.block_manager.reservation_for(len(ids), max_len, final_len)
        if params.num_seqs > 1:
            # each sample / beam must be able to grow to its end on its own, even without sharing
            longest = min(len(ids) + params.max_tokens, self.max_model_len)
            worst = params.num_seqs * -(-longest // self.block_size)
            if worst > self.num_blocks:
                what = f"n={params.n} samples" if params.n > 1 else f"beam_width={params.beam_width} beams"
                raise ValueError(f"{what} of up to {longest} tokens may need {worst} blocks but the pool has only "
                                 f"{self.num_blocks}; lower max_tokens or use a bigger pool")
        rows = reservation
        if reservation is not None and params.num_seqs > 1:
            # a reservation per sample / beam, all taken at admission (engine.contiguous: nothing is shared)
            rows = (reservation,) * params.num_seqs
            if sum(rows) > self.num_blocks * self.block_size:
                what = f"n={params.n} samples" if params.n > 1 else f"beam_width={params.beam_width} beams"
                raise ValueError(f"{what} reserve {params.num_seqs} x {reservation:,} slots but the region holds "
                                 f"{self.num_blocks * self.block_size:,}; the request could never be admitted")
        bad = [t for t in params.stop_token_ids if t >= self.model.config.vocab_size]
        if bad:
            raise ValueError(f"stop token id {bad[0]} is not in the vocabulary [0, {self.model.config.vocab_size})")
        seed = params.seed if params.seed is not None else random.randrange(2**62)
        req = Request(rid, text, ids, params, seed, max_len=min(max_len, reservation or max_len),
                      reservation=rows, priority=priority)
        first_id = rid if params.num_seqs == 1 else (f"{rid}.b0" if params.beam_width > 1 else f"{rid}.0")
        req.seqs.append(Sequence(first_id, list(ids), len(ids), self._generator(seed, 0)))
        if params.beam_width > 1:
            req.beam = BeamState(finished=[(BEAM_NEG, None, None)] * params.beam_width)
        return req

    @staticmethod
    def _generator(seed: int, index: int) -> torch.Generator:
        return torch.Generator(device="cpu").manual_seed(seed + index)

    def _check_prompt_len(self, num_tokens: int, what: str | None = None) -> None:
        """Refuse a prompt of ``num_tokens`` tokens that can never run: more blocks than the pool holds, or
        no room for one generated token within max_model_len (vLLM's rule: prompt + at least one output
        token must fit). ``what`` describes the prompt in the error (default "prompt of N tokens")."""
        what = what or f"prompt of {num_tokens} tokens"
        need = -(-num_tokens // self.block_size)
        if need > self.num_blocks:
            raise ValueError(f"{what} needs {need:,} blocks of {self.block_size} but the pool has only "
                             f"{self.num_blocks}; it can never fit")
        if num_tokens >= self.max_model_len:
            limit = (f"the contiguous reservation of {self.max_model_len} slots (reservation_tokens)"
                     if self.max_model_len < (self.config.max_model_len or 10**9)
                     and self.config.allocator == "contiguous" else f"max_model_len {self.max_model_len}")
            raise ValueError(f"{what} leaves no room to generate within {limit}")

    def _check_text_len(self, text: str) -> None:
        """Refuse a text prompt by its length alone, before tokenizing it (a 10-million-token text took
        ~50 s to tokenize): it has at least ``len / L`` tokens, where ``L`` is the longest token of the
        tokenizer in characters (``_longest_token_chars``), when that bound is sound for the tokenizer."""
        if len(text) < self.max_model_len:  # a character may be several tokens: too short to judge
            return
        longest = self._longest_token_chars()
        if longest is None:
            return
        normalizer = self.tokenizer.backend_tokenizer.normalizer
        chars = len(normalizer.normalize_str(text)) if normalizer is not None else len(text)
        least = -(-chars // longest)
        self._check_prompt_len(least, f"prompt of {len(text):,} characters (at least {least:,} tokens: no token "
                                      f"of this tokenizer is longer than {longest} characters)")

    def _longest_token_chars(self) -> int | None:
        """The most characters one token of the tokenizer covers, or None when no such bound holds.

        A BPE token's vocabulary string covers at least as many characters of the (normalized) text as it
        has: a byte-level token has one character per byte (a text character is 1-4 bytes), a
        SentencePiece piece ("▁the") one per character, a byte-fallback token ("<0x41>") six for one byte.
        No bound: a slow tokenizer, a model other than BPE, unknown characters fused into one "<unk>"
        (no byte fallback), or a pre-tokenizer that drops characters (whitespace splitting). Computed once.
        """
        if not hasattr(self, "_longest_token"):
            self._longest_token = None
            backend = getattr(self.tokenizer, "backend_tokenizer", None)
            if backend is not None:
                spec = json.loads(backend.to_str())
                model = spec.get("model") or {}
                fused_unk = model.get("fuse_unk") and model.get("unk_token") and not model.get("byte_fallback")
                if model.get("type") == "BPE" and not fused_unk and _keeps_characters(spec.get("pre_tokenizer")):
                    self._longest_token = max(map(len, self.tokenizer.get_vocab()), default=0) or None
        return self._longest_token

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty ('')")
            self._check_text_len(prompt)  # by its length, before any per-character or per-token work
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:  # a lone surrogate such as '\ud800', which no tokenizer takes
                raise ValueError(f"prompt has an invalid character {prompt[exc.start]!r} (a lone surrogate, "
                                 f"not Unicode text) at position {exc.start}") from None
            if prompt.isspace():
                raise ValueError(f"prompt is only whitespace ({_shown(prompt)}); give some text")
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            if not ids:
                raise ValueError(f"prompt {_shown(prompt)} encodes to no tokens")
            return prompt, list(ids)
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise ValueError("prompt is empty ([])")
            self._check_prompt_len(len(prompt))  # by its length, before any per-token work
            vocab = self.model.config.vocab_size
            bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
            if bad:
                raise ValueError(f"prompt token id {bad[0]!r} is not an integer")
            ids = [int(t) for t in prompt]  # numpy / torch integers too
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} is not in the vocabulary [0, {vocab})")
            return None, ids
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --------------------------------------------------------------------------------------------- step
    def step(self) -> StepRecord:
        """Run one prefill or decode step and return its record (kind "idle" if nothing is queued)."""
        t0 = time.perf_counter()
        self.step_count += 1
        batch = self.scheduler.schedule()
        self._touched.update(r.request_id for r in batch.requests)
        self.kv_cache.apply(self.block_manager.drain_ops())  # swaps and copy-on-write copies, in order
        out = _StepOutput()
        scheduled: list[ScheduledSequence] = []
        if batch.seqs:
            inputs = []
            owner = {s.seq_id: r.request_id for r in batch.requests for s in r.seqs}
            for seq, n in zip(batch.seqs, batch.num_new_tokens):
                start, end = seq.num_computed_tokens - n, seq.num_computed_tokens
                table, region_start = self.block_manager.attention_view(seq.seq_id)
                inputs.append(SeqInput(seq_id=seq.seq_id, token_ids=seq.token_ids[start:end], start_pos=start,
                                       slot_mapping=self.block_manager.slot_mapping(seq.seq_id, start, end),
                                       block_table=table, region_start=region_start))
                scheduled.append(ScheduledSequence(seq.seq_id, owner[seq.seq_id], n, start))
            logits = self.runner.execute(inputs)
            # a sequence samples once all its tokens are computed: a prefill chunk short of the prompt's
            # end (V1's chunked prefill) discards its logits, as vLLM does
            rows = {seq.seq_id: logits[i] for i, seq in enumerate(batch.seqs)
                    if seq.num_computed_tokens == seq.num_tokens}
            sampled = [r for r in batch.requests if not r.is_beam_search]
            for req in sampled:
                self._fork_samples(req, rows)
            self._sample_step(sampled, rows, out)
            for req in batch.requests:
                if req.is_beam_search:
                    self._beam_step(req, rows, out)
        events = self.log.drain()
        kv_events = self.block_manager.drain_kv_events()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.publish(kv_events)  # queued; sent by the publisher's thread
        return StepRecord(
            step=self.step_count, kind=batch.kind, scheduled=scheduled, events=events,
            new_tokens=out.tokens, new_text=out.text, finished=out.finished, snapshot=self.snapshot(),
            elapsed_s=time.perf_counter() - t0, kv_events=kv_events, semantics=self.semantics,
        )

    def _emit(self, out: "_StepOutput", seq: Sequence, token: int) -> None:
        out.tokens[seq.seq_id] = token
        text = self._token_text.get(token)
        if text is None:  # decoded once per token id: a step emits one text per sequence
            text = self._token_text[token] = self.tokenizer.decode([token])
        out.text[seq.seq_id] = text

    def _fork_samples(self, req: Request, rows: dict) -> None:
        """Parallel sampling: right after the prompt's prefill, fork the ``n - 1`` other samples off the
        first; they share its blocks and its logits, and each has its own random stream."""
        p = req.params
        if p.n > 1 and len(req.seqs) == 1 and not req.seqs[0].output_token_ids:
            parent = req.seqs[0]
            for i in range(1, p.n):
                child = Sequence(f"{req.request_id}.{i}", list(parent.token_ids), parent.prompt_len,
                                 self._generator(req.seed, i), num_computed_tokens=parent.num_computed_tokens,
                                 status=RUNNING)
                self.block_manager.fork(parent.seq_id, child.seq_id)
                req.seqs.append(child)
                rows[child.seq_id] = rows[parent.seq_id]

    def _sample_step(self, requests: list[Request], rows: dict, out: "_StepOutput") -> None:
        """Sample the next token of every sequence of these requests that ran, all in one batch."""
        todo = [(req, seq) for req in requests for seq in req.live_seqs if seq.seq_id in rows]
        if not todo:
            return
        tokens = sample_batch(torch.stack([rows[seq.seq_id] for _, seq in todo]),
                              [req.params for req, _ in todo], [seq.generator for _, seq in todo])
        for (req, seq), token in zip(todo, tokens):
            seq.token_ids.append(token)
            self._emit(out, seq, token)
            reason = self._finish_reason(req, seq, token)
            if reason:
                self.scheduler.finish_seq(req, seq, reason)
                out.finished.append(seq.seq_id)
        for req in requests:
            if not req.live_seqs and req.status != FINISHED:
                self._finish(req, req.seqs[0].finish_reason)

    def _finish(self, req: Request, reason: str) -> None:
        if req.is_beam_search:
            best = next((ids for _, ids, _ in req.beam.finished if ids is not None), None)
            length = len(best) - len(req.prompt_token_ids) if best else 0
        else:
            length = max(len(s.output_token_ids) for s in req.seqs)
        self.scheduler.finish(req, reason, length)
        req.finish_step = self.step_count

    def _beam_step(self, req: Request, rows: dict, out: "_StepOutput") -> None:
        """One step of beam search on the live beams, mirroring transformers' ``_beam_search`` (v5):
        top 2w continuations over all beams, the best w that did not stop continue, stopped ones among the
        top w enter the finished list with score / generated_length ** length_penalty, and the search ends
        when no running beam can beat the worst finished one (early_stopping=False) or every continuation
        stops. Beams that continue from one parent are forks of it (sharing its blocks; the next write copies
        the shared last block); parents nobody continues are freed."""
        live = req.live_seqs
        cands = self._beam_candidates(req, live, rows)
        req.beam.finished = self._beam_hypotheses(req, live, cands)
        if self._beam_search_done(req, cands):
            out.finished.extend(s.seq_id for s in live)
            self._finish(req, req.beam.finished[0][2] or "length")
            return
        self._beam_continue(req, live, cands, out)

    def _beam_candidates(self, req: Request, live: list[Sequence], rows: dict) -> "_BeamCandidates":
        """The top 2w continuations over all live beams by accumulated log-probability, which of them stop
        (EOS, a stop token, or the length limit), and the w that keep running (transformers' steps a-e)."""
        w = req.params.beam_width
        log_probs = torch.log_softmax(torch.stack([rows[s.seq_id] for s in live]).float().cpu(), dim=-1)
        vocab = log_probs.shape[-1]
        accumulated = (log_probs + torch.tensor([s.score for s in live])[:, None]).reshape(-1)
        scores, index = torch.topk(accumulated, 2 * w)
        tokens = (index % vocab).tolist()
        length = live[0].num_tokens + 1  # every beam's length after this step
        stops = torch.tensor([self._is_stop(req.params, t) or length >= req.max_len for t in tokens])
        running_scores = scores + stops.to(torch.float32) * BEAM_NEG
        return _BeamCandidates(scores, (index // vocab).tolist(), tokens, stops, running_scores,
                               torch.topk(running_scores, w)[1].tolist(), length)

    def _beam_hypotheses(self, req: Request, live: list[Sequence], c: "_BeamCandidates") -> list:
        """The w best finished hypotheses so far: the old ones merged with the candidates among the top w
        that stopped, each scored by score / generated_length ** length_penalty (transformers' step f)."""
        p, beam = req.params, req.beam
        w, prompt_len = p.beam_width, len(req.prompt_token_ids)
        just_finished = c.stops & (torch.arange(2 * w) < w)
        fin = c.scores / ((c.length - prompt_len) ** p.length_penalty)
        fin = fin + float(not beam.improvable) * BEAM_NEG
        fin = fin + (~just_finished).to(torch.float32) * BEAM_NEG
        merged = torch.cat([torch.tensor([f[0] for f in beam.finished], dtype=torch.float32), fin])
        best = []
        for k in torch.topk(merged, w)[1].tolist():
            if k < w:
                best.append(beam.finished[k])
                continue
            j = k - w
            token = c.tokens[j]
            reason = None
            if bool(just_finished[j]):
                reason = "stop" if self._is_stop(p, token) else "length"
            best.append((float(merged[k]), live[c.parents[j]].token_ids + [token], reason))
        return best

    def _beam_search_done(self, req: Request, c: "_BeamCandidates") -> bool:
        """transformers' stopping heuristic (step g, early_stopping=False): done when the best running beam
        cannot beat the worst finished hypothesis, or when every candidate stopped."""
        p, beam = req.params, req.beam
        best_running = c.running_scores[c.keep[0]] / ((c.length - len(req.prompt_token_ids)) ** p.length_penalty)
        scores = torch.tensor([f[0] for f in beam.finished], dtype=torch.float32)
        done = torch.tensor([f[2] is not None for f in beam.finished])
        worst = torch.where(done, scores.min(), torch.tensor(BEAM_NEG))
        beam.improvable = beam.improvable and bool(torch.any(best_running > worst))
        return not beam.improvable or bool(c.stops.all())

    def _beam_continue(self, req: Request, live: list[Sequence], c: "_BeamCandidates", out: "_StepOutput") -> None:
        """The w running beams for the next step: the first beam continuing a parent reuses its sequence,
        the others fork it (sharing its blocks); parents nobody continues are freed."""
        claimed: set[int] = set()
        plan = []
        for j in c.keep:
            parent = live[c.parents[j]]
            if c.parents[j] in claimed:
                child = Sequence(f"{req.request_id}.b{req.beam.next_beam}", list(parent.token_ids), parent.prompt_len,
                                 num_computed_tokens=parent.num_computed_tokens, status=RUNNING)
                req.beam.next_beam += 1
                self.block_manager.fork(parent.seq_id, child.seq_id)
                plan.append((child, c.tokens[j], float(c.running_scores[j])))
            else:
                claimed.add(c.parents[j])
                plan.append((parent, c.tokens[j], float(c.running_scores[j])))
        for i, s in enumerate(live):
            if i not in claimed:
                self.scheduler.finish_seq(req, s, "pruned")
        for seq, token, score in plan:
            seq.token_ids.append(token)
            seq.score = score
            self._emit(out, seq, token)
        req.seqs = [seq for seq, _, _ in plan]  # beam order = score order, as transformers keeps it

    def _is_stop(self, params: SamplingParams, token: int) -> bool:
        """Whether ``token`` ends the reply: the end-of-sequence token (unless ``ignore_eos``) or a stop token."""
        eos = None if params.ignore_eos else self.tokenizer.eos_token_id
        return (eos is not None and token == eos) or token in params.stop_token_ids

    def _finish_reason(self, req: Request, seq: Sequence, token: int) -> str | None:
        if self._is_stop(req.params, token):
            return "stop"
        if seq.num_tokens >= req.max_len:  # max_tokens, max_model_len or a contiguous reservation
            return "length"
        return None

    # ----------------------------------------------------------------------------------------- outputs
    def snapshot(self) -> Snapshot:
        """Pool, block tables and sequences now. Finished sequences appear in the snapshot of the step they
        finished in (with their last block table), not afterwards, so a snapshot stays as small as the
        live batch."""
        bm = self.block_manager
        for rid in [r for r in self._leaving if self._listed[r].finish_step != self.step_count]:
            del self._listed[rid], self._states[rid]
            self._leaving.discard(rid)
        running = {r.request_id for r in self.scheduler.running}
        # a request changes only when added, scheduled (admitted, run, swapped in, finished) or preempted
        # (running before); one that waits untouched keeps its states (SequenceState is never mutated)
        for rid in self._touched | self._was_running | running:
            req = self._listed.get(rid)
            if req is None:  # finished and dropped already
                continue
            self._states[rid] = self._sequence_states(req, bm)
            if req.status == FINISHED:
                self._leaving.add(rid)
        self._touched, self._was_running = set(), running
        states = list(chain.from_iterable(map(self._states.__getitem__, self._listed)))
        request_id = attrgetter("request_id")
        queues = dict(waiting=list(map(request_id, self.scheduler.waiting)),
                      running=list(map(request_id, self.scheduler.running)),
                      swapped=list(map(request_id, self.scheduler.swapped)))
        snapshot = make_snapshot(sequences=states, **bm.snapshot_fields(), **queues)
        bm.snapshot_taken(snapshot)  # the paged manager records the next one relative to it
        return snapshot

    @staticmethod
    def _sequence_states(req: Request, bm) -> tuple[SequenceState, ...]:
        """The snapshot's view of each sequence of ``req`` now (a finished one with its last block table)."""
        states = []
        for seq in req.seqs:
            held = bm.table_of(seq.seq_id)
            table, n = held if held else (seq.last_block_table if seq.status == FINISHED else [], 0)
            states.append(SequenceState(
                seq_id=seq.seq_id, request_id=req.request_id, status=seq.status, prompt_len=seq.prompt_len,
                num_generated=len(seq.output_token_ids), num_tokens=n, block_table=list(table),
                token_ids=list(seq.token_ids), finish_reason=seq.finish_reason,
            ))
        return tuple(states)

    def get_output(self, request_id: str) -> RequestOutput:
        """The request's output so far (``finish_reason`` None while it runs). Raises KeyError if unknown.

        ``outputs``: one entry per sample in sample order, or per beam hypothesis best first (while a beam
        search runs: its live beams)."""
        if request_id in self.parents:
            return self._parent_output(request_id)
        req = self.requests[request_id]
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        prompt_len = len(req.prompt_token_ids)
        if req.is_beam_search and req.status == FINISHED:
            hyps = [h for h in req.beam.finished if h[1] is not None]
            outputs = [CompletionOutput(i, ids[prompt_len:], decode(ids[prompt_len:]), reason, score)
                       for i, (score, ids, reason) in enumerate(hyps)]
        else:
            outputs = [CompletionOutput(i, s.output_token_ids, decode(s.output_token_ids), s.finish_reason, s.score)
                       for i, s in enumerate(req.seqs)]
        first = req.seqs[0] if req.seqs else None
        table = []
        if first is not None:
            held = self.block_manager.table_of(first.seq_id)
            table = held[0] if held else first.last_block_table
        best = outputs[0]
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=list(req.prompt_token_ids),
            output_token_ids=list(best.token_ids), output_text=best.text,
            finish_reason=req.finish_reason if req.status == FINISHED else None, block_table=list(table),
            num_preemptions=req.num_preemptions, outputs=outputs,
            num_cached_tokens=req.num_cached_tokens if self.semantics == "v1" and req.num_cached_tokens >= 0 else None,
        )

    def _parent_output(self, request_id: str) -> RequestOutput:
        """V1: the output of a request with n > 1, gathered from its child requests (sample i = child i).
        Finished when every child is. ``num_cached_tokens`` is that of the child that finished last (the
        later one of a step), as vLLM's ``ParentRequest`` reports it; each child's own is on its output."""
        kids = [self.get_output(c) for c in self.parents[request_id]]
        last = max(range(len(kids)), key=lambda i: (self.requests[self.parents[request_id][i]].finish_step, i))
        outputs = [dataclasses.replace(k.outputs[0], index=i, finish_reason=k.finish_reason)
                   for i, k in enumerate(kids)]
        first = kids[0]
        done = all(k.finished for k in kids)
        return RequestOutput(
            request_id=request_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
            output_token_ids=list(first.output_token_ids), output_text=first.output_text,
            finish_reason=first.finish_reason if done else None, block_table=first.block_table,
            num_preemptions=sum(k.num_preemptions for k in kids), outputs=outputs,
            num_cached_tokens=kids[last].num_cached_tokens,
        )

    def generate(self, prompts: str | list, params: SamplingParams | list[SamplingParams] | None = None,
                 on_step=None) -> list[RequestOutput]:
        """Add every prompt, step until all finish, return their outputs in prompt order.

        ``prompts``: one prompt or a list (each a string or a list of token ids). ``params``: one for all
        or one per prompt. ``on_step``: optional callback receiving each StepRecord.

        Raises:
            ValueError: a bad prompt or params; every prompt is checked before any is added.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [self._check_params(params)] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        ids = self._auto_ids(len(prompts))
        made = [self._make_requests(p, sp, rid) for rid, p, sp in zip(ids, prompts, params_list)]
        for req in (r for group in made for r in group):  # all valid: only now is anything added
            self._enqueue(req)
        while any(r.status != FINISHED for group in made for r in group):
            record = self.step()
            if on_step is not None:
                on_step(record)
        return [self.get_output(r) for r in ids]

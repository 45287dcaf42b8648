"""``LLMEngine``: the public entry point (names follow vLLM's).

    engine = LLMEngine(EngineConfig(block_size=16, num_blocks=64))
    rid = engine.add_request("ROMEO. ", SamplingParams(max_tokens=20, temperature=0))
    while engine.has_unfinished():
        record = engine.step()          # one prefill or decode step -> StepRecord
    print(engine.get_output(rid).output_text)

One step is schedule -> run -> update -> record: the scheduler decides and writes it down as plain data
(``engine.scheduler_output.SchedulerOutput``); the model runner reads only that (applies its copies and
swaps, computes its tokens with K/V in the paged pool); the engine samples (``engine.beam_search`` decides a
beam step); the scheduler takes the tokens back (``update_from_output``: appends, finishes, frees, forks);
a ``StepRecord`` describes all of it. Requests come in through ``engine.input_processor`` and go out through
``engine.output_processor``.
"""

from __future__ import annotations

import dataclasses
import numbers
import time
from itertools import chain
from operator import attrgetter

import torch

import kernels

from . import beam_search
from .allocator import KVAllocator
from .block_manager import BlockManager
from .contiguous import ContiguousAllocator
from .config import DEFAULT_MAX_NUM_BATCHED_TOKENS_V1, EngineConfig, SamplingParams
from .input_processor import InputProcessor
from .kv_cache import KVCache, check_groups_supported, kv_cache_groups, num_blocks_for_budget, page_bytes
from .memory_check import check_memory
from .model_loader import geometry_from_config, load_model, resolve_device, resolve_dtype
from .model_runner import ModelRunner
from .output_processor import parent_output, request_output, sequence_states
from .records import (EventLog, ScheduledSequence, SequenceState, Snapshot, StepRecord, kv_cache_group_dicts,
                      make_snapshot)
from .sampler import sample_batch
from .threads import engine_threads
from .scheduler import Scheduler
from .scheduler_v1 import SchedulerV1
from .sequence import FINISHED, Request, RequestOutput

DEFAULT_POOL_REQUESTS = 4  # with neither num_blocks nor a budget, the pool holds 4 x max_model_len tokens
# A step's record keeps only the blocks the step changed, but a step a view draws builds its full per-block
# lists (count, fill, owners, hash): 5.5 MB a step at 65,536 blocks (tracemalloc, CPython 3.11), so a
# 3-million-block pool, when every step was built, kept ~250 MB a step until the process was killed. A
# larger pool is refused; the same memory at a larger block size is allowed.
MAX_RECORDED_BLOCKS = 65_536


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
        # torch's threads: the caller's choice, else as vLLM's CPU backend picks them (engine.threads)
        self.num_threads, self.threads_why = engine_threads(config.num_threads)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.backend = kernels.resolve_backend(config.attention_backend, self.device)
        self.model, self.tokenizer = loaded or load_model(config.model, self.device, self.dtype)
        self.geometry = geometry_from_config(self.model.config, self.dtype)
        # vLLM's KV cache groups (one for a model whose layers all attend to everything); refused here
        # where the semantics keep one table for every layer (ValueError, saying why)
        self.kv_cache_groups = kv_cache_groups(self.model.config)
        check_groups_supported(self.kv_cache_groups, config.model, config.semantics)
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
        check_memory(self.device, self.num_blocks, self.block_size,
                     page_bytes(self.geometry, self.block_size, self.kv_cache_groups),
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
        self.processor = InputProcessor(config, self.tokenizer, self.model.config.vocab_size, self.block_manager,
                                        self.max_model_len, self.block_size, self.num_blocks)
        if self.semantics == "v1":
            self.scheduler = SchedulerV1(self.block_manager, config.max_num_seqs, max_batched, self.max_model_len,
                                         policy=config.scheduling_policy,
                                         # vLLM counts its null block in the pool the watermark is a share of
                                         watermark_blocks=int(config.watermark * (self.num_blocks + 1)),
                                         log=self.log, eos_token_id=self.tokenizer.eos_token_id)
        else:
            self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, max_batched,
                                       config.preemption_mode, log=self.log, eos_token_id=self.tokenizer.eos_token_id)
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
                                 evict_uncached_first=config.semantics == "v1", groups=self.kv_cache_groups)
        # a sliding group's admission cap: the window plus one step's tokens in flight (no async scheduling)
        allocator.set_max_in_flight_tokens(self.max_num_batched_tokens, self.max_model_len)
        kv_cache = KVCache(self.geometry, self.num_blocks, self.block_size, self.device, dtype,
                           num_swap_blocks=swap_blocks, groups=self.kv_cache_groups)
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
            return num_blocks_for_budget(config.kv_budget_bytes, self.geometry, self.block_size, self.kv_cache_groups)
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
                ``_make_request``; n above ``config.MAX_N_SEQUENCES`` is refused by ``SamplingParams``).
                The engine is unchanged. (A deployment's cap on requests per run is the app's to check
                before it adds one.)
        """
        params = self._check_params(params)
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
        return self.processor.child_requests(parent, params, rid, lambda i: i in self.requests or i in self.parents)

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
        """Validate and tokenize (``InputProcessor.make_request``) under a free id; raises ValueError and
        changes nothing on bad input."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request_id must be a non-empty string, got {rid!r}")
        if rid in self.requests or rid in self.parents:
            raise ValueError(f"request_id {rid!r} is already in use")
        return self.processor.make_request(prompt, params, rid, final_len, priority)

    def _longest_token_chars(self) -> int | None:
        return self.processor.longest_token_chars()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --------------------------------------------------------------------------------------------- step
    def step(self) -> StepRecord:
        """One step: schedule -> run -> update -> record (kind "idle" if nothing is queued).

        The scheduler writes its decisions down (``SchedulerOutput``); the model runner reads only that
        (applies its copies and swaps, computes its tokens); the engine samples each sequence whose tokens
        are all computed (a V1 prefill chunk short of the prompt's end discards its logits, as vLLM does)
        and decides each beam search's step (``engine.beam_search``); the scheduler takes the tokens back
        (``update_from_output``: appends, finishes, frees, forks); the step's events become its record."""
        t0 = time.perf_counter()
        self.step_count += 1
        output = self.scheduler.schedule()
        self._touched.update(output.req_ids)
        rows = self.runner.execute_model(output)
        for child, parent in output.sample_from.items():  # the n samples share their prompt's logits
            rows.setdefault(child, rows[parent])  # (a replaying runner answers each sample itself)
        requests = [self.requests[rid] for rid in output.req_ids]
        sampled = self._sample([r for r in requests if not r.is_beam_search], rows)
        beams = {r.request_id: beam_search.decide(r, rows, self.scheduler.is_stop)
                 for r in requests if r.is_beam_search}
        update = self.scheduler.update_from_output(output, sampled, beams)
        events = self.log.drain()
        kv_events = self.block_manager.drain_kv_events()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.publish(kv_events)  # queued; sent by the publisher's thread
        scheduled = [ScheduledSequence(s.seq_id, s.req_id, s.num_new_tokens, s.num_computed_tokens)
                     for s in output.scheduled]
        return StepRecord(
            step=self.step_count, kind=output.kind, scheduled=scheduled, events=events,
            new_tokens=update.new_tokens, new_text={s: self._text(t) for s, t in update.new_tokens.items()},
            finished=update.finished, snapshot=self.snapshot(), elapsed_s=time.perf_counter() - t0,
            kv_events=kv_events, semantics=self.semantics,
        )

    def _text(self, token: int) -> str:
        """A token's text alone, decoded once per token id (a step emits one text per sequence)."""
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.decode([token])
        return text

    @staticmethod
    def _sample(requests: list[Request], rows: dict) -> dict[str, int]:
        """The next token of every live sequence of these requests that has logits, all in one batch."""
        todo = [(req, seq) for req in requests for seq in req.live_seqs if seq.seq_id in rows]
        if not todo:
            return {}
        tokens = sample_batch(torch.stack([rows[seq.seq_id] for _, seq in todo]),
                              [req.params for req, _ in todo], [seq.generator for _, seq in todo])
        return {seq.seq_id: token for (_, seq), token in zip(todo, tokens)}

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
        snapshot = make_snapshot(sequences=states, **bm.snapshot_fields(), **queues,
                                 kv_cache_groups=kv_cache_group_dicts(getattr(bm, "groups", None)))
        bm.snapshot_taken(snapshot)  # the paged manager records the next one relative to it
        return snapshot

    _sequence_states = staticmethod(sequence_states)

    def get_output(self, request_id: str) -> RequestOutput:
        """The request's output so far (``finish_reason`` None while it runs). Raises KeyError if unknown.

        ``outputs``: one entry per sample in sample order, or per beam hypothesis best first (while a beam
        search runs: its live beams). In V1 a request with n > 1 gathers its child requests' outputs."""
        if request_id in self.parents:
            kids = self.parents[request_id]
            return parent_output(request_id, [self.get_output(c) for c in kids], [self.requests[c] for c in kids])
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        return request_output(self.requests[request_id], decode, self.block_manager, self.semantics == "v1")

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

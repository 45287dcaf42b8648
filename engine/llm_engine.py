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

import random
import time

import torch

import kernels

from .block_manager import BlockManager
from .config import EngineConfig, SamplingParams
from .kv_cache import KVCache, num_blocks_for_budget
from .model_loader import geometry_from_config, load_model, resolve_device, resolve_dtype
from .model_runner import ModelRunner, SeqInput
from .records import RequestState, ScheduledRequest, Snapshot, StepRecord
from .sampler import sample
from .scheduler import Scheduler
from .sequence import FINISHED, Request, RequestOutput

DEFAULT_POOL_REQUESTS = 4  # with neither num_blocks nor a budget, the pool holds 4 x max_model_len tokens


class LLMEngine:
    """A paged-KV serving engine around one transformers model.

    Raises (constructor):
        ValueError: a config value that cannot work here (unknown device, a budget below one block,
            max_model_len above the model's or the pool's limit), naming the value.
        engine.model_loader.ModelLoadError (a ValueError): the model cannot be found or is unsupported.
    """

    def __init__(self, config: EngineConfig | None = None) -> None:
        config = config or EngineConfig()
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.backend = kernels.resolve_backend(config.attention_backend, self.device)
        self.model, self.tokenizer = load_model(config.model, self.device, self.dtype)
        self.geometry = geometry_from_config(self.model.config, self.dtype)
        self.block_size = config.block_size

        model_max = self.model.config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_max:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's max_position_embeddings {model_max}"
            )
        self.num_blocks = self._pool_blocks(config, model_max)
        capacity = self.num_blocks * self.block_size
        if config.max_model_len is not None and config.max_model_len > capacity:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the pool's {capacity} token slots "
                f"({self.num_blocks} blocks x {self.block_size}); one request could never finish"
            )
        self.max_model_len = config.max_model_len or min(model_max, capacity)
        max_batched = config.max_num_batched_tokens or max(self.max_model_len, 2048)
        if max_batched < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens {max_batched} is below max_model_len {self.max_model_len}; "
                f"a long request could never be prefilled"
            )

        self.block_manager = BlockManager(self.num_blocks, self.block_size)
        self.kv_cache = KVCache(self.geometry, self.num_blocks, self.block_size, self.device,
                                next(self.model.parameters()).dtype)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, max_batched)
        self.runner = ModelRunner(self.model, self.kv_cache, self.backend)
        self.requests: dict[str, Request] = {}
        self.step_count = 0
        self._next_id = 1

    def _pool_blocks(self, config: EngineConfig, model_max: int) -> int:
        if config.num_blocks is not None:
            return config.num_blocks
        if config.kv_budget_bytes is not None:
            return num_blocks_for_budget(config.kv_budget_bytes, self.geometry, self.block_size)
        tokens = DEFAULT_POOL_REQUESTS * (config.max_model_len or model_max)
        return -(-tokens // self.block_size)

    # ------------------------------------------------------------------------------------------ requests
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; returns its id ("R1", "R2", ... unless given).

        Raises:
            ValueError: empty prompt, a token id outside the vocabulary, a duplicate id, a prompt that can
                never fit in the pool or leaves no room to generate within max_model_len. The engine is
                unchanged.
        """
        rid = request_id if request_id is not None else f"R{self._next_id}"
        request = self._make_request(prompt, params or SamplingParams(), rid)
        self._enqueue(request, auto_id=request_id is None)
        return rid

    def _enqueue(self, request: Request, auto_id: bool) -> None:
        self.requests[request.request_id] = request
        self.scheduler.add(request)
        if auto_id:
            self._next_id += 1

    def _make_request(self, prompt, params: SamplingParams, rid: str) -> Request:
        """Validate and tokenize; raises ValueError and changes nothing on bad input."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request_id must be a non-empty string, got {rid!r}")
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        text, ids = self._tokenize(prompt)
        need = self.block_manager.blocks_needed(len(ids))
        if need > self.num_blocks:
            raise ValueError(
                f"prompt of {len(ids)} tokens needs {need} blocks of {self.block_size} but the pool has only "
                f"{self.num_blocks}; it can never fit"
            )
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens leaves no room to generate within max_model_len {self.max_model_len}"
            )
        seed = params.seed if params.seed is not None else random.randrange(2**63)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        return Request(rid, text, ids, params, gen)

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty ('')")
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            if not ids:
                raise ValueError(f"prompt {prompt!r} encodes to no tokens")
            return prompt, list(ids)
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise ValueError("prompt is empty ([])")
            vocab = self.model.config.vocab_size
            bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token id {bad[0]!r} is not in the vocabulary [0, {vocab})")
            return None, list(prompt)
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --------------------------------------------------------------------------------------------- step
    def step(self) -> StepRecord:
        """Run one prefill or decode step and return its record (kind "idle" if nothing is queued)."""
        t0 = time.perf_counter()
        self.step_count += 1
        batch = self.scheduler.schedule()
        self.kv_cache.copy_blocks(self.block_manager.drain_copies())
        new_tokens: dict[str, int] = {}
        new_text: dict[str, str] = {}
        finished: list[str] = []
        scheduled: list[ScheduledRequest] = []
        if batch.requests:
            inputs = []
            for req, n in zip(batch.requests, batch.num_new_tokens):
                start = req.num_cached - n
                inputs.append(SeqInput(
                    request_id=req.request_id,
                    token_ids=req.all_token_ids[start:req.num_cached],
                    start_pos=start,
                    slot_mapping=self.block_manager.slot_mapping(req.request_id, start, req.num_cached),
                    block_table=self.block_manager.block_tables[req.request_id],
                ))
                scheduled.append(ScheduledRequest(req.request_id, n, start))
            logits = self.runner.execute(inputs)
            for i, req in enumerate(batch.requests):
                token = sample(logits[i], req.params, req.generator)
                req.output_token_ids.append(token)
                new_tokens[req.request_id] = token
                new_text[req.request_id] = self.tokenizer.decode([token])
                reason = self._finish_reason(req, token)
                if reason:
                    self.scheduler.finish(req, reason)
                    finished.append(req.request_id)
        events = self.block_manager.drain_events()
        return StepRecord(
            step=self.step_count, kind=batch.kind, scheduled=scheduled, events=events,
            new_tokens=new_tokens, new_text=new_text, finished=finished, snapshot=self.snapshot(),
            elapsed_s=time.perf_counter() - t0,
        )

    def _finish_reason(self, req: Request, token: int) -> str | None:
        eos = self.tokenizer.eos_token_id
        if not req.params.ignore_eos and eos is not None and token == eos:
            return "stop"
        if len(req.output_token_ids) >= req.params.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    # ----------------------------------------------------------------------------------------- outputs
    def snapshot(self) -> Snapshot:
        bm = self.block_manager
        states = []
        for req in self.requests.values():
            table = bm.block_tables.get(req.request_id, req.last_block_table if req.status == FINISHED else [])
            states.append(RequestState(
                request_id=req.request_id, status=req.status, prompt_len=len(req.prompt_token_ids),
                num_generated=len(req.output_token_ids),
                num_tokens=bm.num_tokens.get(req.request_id, 0), block_table=list(table),
                token_ids=req.all_token_ids, finish_reason=req.finish_reason,
            ))
        return Snapshot(
            num_blocks=bm.num_blocks, block_size=bm.block_size, num_free_blocks=bm.num_free_blocks,
            ref_counts=list(bm.ref_counts), fills=list(bm.fills), owners=bm.owners(), requests=states,
            waiting=[r.request_id for r in self.scheduler.waiting],
            running=[r.request_id for r in self.scheduler.running],
        )

    def get_output(self, request_id: str) -> RequestOutput:
        """The request's output so far (``finish_reason`` None while it runs). Raises KeyError if unknown."""
        req = self.requests[request_id]
        table = self.block_manager.block_tables.get(request_id, req.last_block_table)
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=list(req.prompt_token_ids),
            output_token_ids=list(req.output_token_ids),
            output_text=self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True),
            finish_reason=req.finish_reason, block_table=list(table), num_preemptions=req.num_preemptions,
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
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        made = [self._make_request(p, sp, f"R{self._next_id + i}")
                for i, (p, sp) in enumerate(zip(prompts, params_list))]
        for req in made:  # all valid: only now is anything added
            self._enqueue(req, auto_id=True)
        ids = [req.request_id for req in made]
        while any(self.requests[r].status != FINISHED for r in ids):
            record = self.step()
            if on_step is not None:
                on_step(record)
        return [self.get_output(r) for r in ids]

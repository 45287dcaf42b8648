"""Validated configuration objects: ``EngineConfig`` and ``SamplingParams`` (names follow vLLM).

Every check raises ``ValueError`` naming the bad field and value, at construction time, so a bad value
never reaches the engine and nothing already in the engine is touched.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from .request_queue import FCFSRequestQueue, REQUEST_QUEUES

# The embedded default model that the project trains itself (assets/tiny_model/train.py).
EMBEDDED_MODEL = str(Path(__file__).resolve().parent.parent / "assets" / "tiny_model")
# The embedded hybrid model (assets/tiny_hybrid_model/train.py; issue 25): layers 0, 2 attend over a sliding window
# of 48 tokens, layers 1, 3 to everything.
EMBEDDED_HYBRID_MODEL = str(Path(__file__).resolve().parent.parent / "assets" / "tiny_hybrid_model")


def resolved_model_path(model: str) -> str:
    """The canonical form of a model name: a local folder's real path (``~`` expanded, symlinks and
    ``..`` resolved, no trailing slash), so every spelling of one folder names one cached copy; a hub id
    as given."""
    path = os.path.expanduser(model.strip())
    return os.path.realpath(path) if os.path.isdir(path) else model.strip()


def is_local_model(model: str) -> bool:
    """Whether ``model`` names a local folder (else it is a hub id)."""
    return os.path.isdir(os.path.expanduser(model.strip()))


DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("float32", "float16", "bfloat16")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
PREEMPTION_MODES = ("recompute", "swap")
MAX_SEED = 2**62  # sample i of n uses seed + i; torch generators take 64-bit seeds
ALLOCATORS = ("paged", "contiguous")
CONTIGUOUS_POLICIES = ("max", "max_tokens", "pow2", "oracle")  # engine.contiguous explains each
FINAL_LENGTH_POLICIES = ("pow2", "oracle")  # the policies that must know each request's final length
# "paper": vLLM V0 as the PagedAttention paper describes it (a step is prefill or decode; fork and
# copy-on-write for parallel samples and beams; preemption by recompute or swap).
# "v1": vLLM V1 (vllm/v1/core/sched/scheduler.py): one token budget per step shared by decode tokens and
# prefill chunks, n samples as child requests over the prefix cache, preemption by recompute only.
SEMANTICS = ("paper", "v1")
# V1's scheduling policies (vLLM's SchedulerConfig.policy): the names of engine.request_queue's registry, which
# the CLI's choices, the scenario file's schema and the Playground's choices read through this tuple
SCHEDULING_POLICIES = tuple(REQUEST_QUEUES)
PAPER_SCHEDULING_POLICY = FCFSRequestQueue.name  # the paper's scheduler is first come, first served
DEFAULT_WATERMARK = {"paper": 0.01, "v1": 0.0}  # vLLM v0's BlockSpaceManager / vLLM V1's SchedulerConfig
DEFAULT_MAX_NUM_BATCHED_TOKENS_V1 = 2048  # V1's token budget when none is given
# Most samples (n) or beams one request may ask for: vLLM's ``VLLM_MAX_N_SEQUENCES`` default (its
# ``SamplingParams._verify_args`` refuses a larger n, "to prevent denial-of-service via excessively large
# fan-out"). V1 turns n into n child requests, each with its own prompt copy and random stream.
MAX_N_SEQUENCES = 16384
ZMQ_TRANSPORTS = ("tcp://", "ipc://", "inproc://")  # where KV events can be published


def check_endpoint(value, name: str = "endpoint", bind: bool = False) -> str:
    """A ZMQ endpoint as KV events use them, or ValueError naming ``name`` and the value: one of
    ``ZMQ_TRANSPORTS``; for tcp, ``tcp://HOST:PORT`` with PORT 1..65535 (0 or ``*``, "any free port", and the
    wildcard host ``*`` only where the socket binds: a subscriber connects to a real host)."""
    if not isinstance(value, str) or not value.startswith(ZMQ_TRANSPORTS):
        raise ValueError(f"{name} must be a ZMQ endpoint starting with one of {', '.join(ZMQ_TRANSPORTS)}, "
                         f"got {value!r} (e.g. tcp://127.0.0.1:5557)")
    if value.startswith("tcp://"):
        host, _, port = value[len("tcp://"):].rpartition(":")
        if not host:
            raise ValueError(f"{name} {value!r} needs a host and a port, e.g. tcp://127.0.0.1:5557")
        free = port in ("0", "*") and bind
        if not free and (not port.isdigit() or not 1 <= int(port) <= 65535):
            raise ValueError(f"{name} {value!r}: the port must be a number from 1 to 65535, got {port!r}")
        if not bind and host in ("*", "0.0.0.0", "[::]", "::"):
            raise ValueError(f"{name} {value!r} is the address a server binds; connect to the server's host "
                             f"instead, e.g. tcp://127.0.0.1:{port}")
    return value


def _check_positive_int(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass
class EngineConfig:
    """How the engine is built.

    Attributes:
        model: local directory or hub id of a Llama-family causal LM; default: the embedded tiny model.
        block_size: tokens per KV block (>= 1; vLLM's default is 16).
        num_blocks: physical blocks in the pool. Give this or ``kv_budget_bytes`` (not both); with
            neither, the pool holds ``max_model_len`` tokens x 4 requests.
        kv_budget_bytes: KV memory budget in bytes; the pool gets ``budget // bytes_per_block`` blocks,
            where bytes_per_block = 2 (K, V) x layers x KV heads x head_dim x element size x block_size.
        max_model_len: longest sequence (prompt + output, tokens). Default: the model's
            ``max_position_embeddings``, capped to what the pool can hold. Must not exceed the pool,
            so a lone request can always finish (the scheduler never deadlocks).
        max_num_seqs: most sequences in one batch.
        max_num_batched_tokens: most tokens one step may compute. Paper semantics: a prefill step's budget, at
            least ``max_model_len``; V1 semantics: the budget decode tokens and prefill chunks share (a
            longer prompt is prefilled in chunks), default 2,048.
        device: "auto" (CUDA when present, else CPU), "cpu" or "cuda".
        dtype: None (float32 on CPU, bfloat16 on CUDA) or one of "float32", "float16", "bfloat16".
        attention_backend: "auto" (Triton on CUDA, PyTorch reference elsewhere), "torch" or "triton".
        enable_prefix_caching: reuse the KV blocks of identical prompt prefixes (automatic prefix caching).
        preemption_mode: what happens to the request evicted when the pool runs out: "recompute" (free its
            blocks, prefill it again later) or "swap" (copy its blocks to a CPU swap pool and back; falls
            back to recompute when the swap pool is full).
        swap_space_blocks: blocks in the CPU swap pool; None means as many as the GPU pool in "swap" mode
            and none in "recompute" mode.
        allocator: "paged" (block pool) or "contiguous" (the baseline: one flat region of
            num_blocks x block_size slots, the same bytes, where each request reserves
            ``reservation_tokens`` contiguous slots first-fit at admission).
        reservation_tokens: slots each request reserves in contiguous mode under the "max" policy; None
            means max_model_len. A request also stops at its reservation.
        contiguous_policy: how much a request reserves in contiguous mode (the vLLM paper's baselines):
            "max" (``reservation_tokens``), "max_tokens" (prompt + max_tokens), "pow2" (the next power of
            two of its true final length) or "oracle" (exactly its true final length); the last two need
            the final length in advance (``LLMEngine.add_request(final_len=...)``).
        watermark: share of the paged pool that admission and swap-in keep free, in [0, 1), so a request
            just admitted is not preempted at once; None takes the semantics' default: 0.01 in "paper"
            (vLLM v0's ``int(0.01 x num_blocks)`` blocks), 0 in "v1" (vLLM V1's ``SchedulerConfig.watermark``).
            0 keeps the exact pool (the lessons).
        semantics: "paper" (vLLM V0 as the PagedAttention paper describes it: prefill or decode steps, fork
            and copy-on-write, beam search, swap) or "v1" (vLLM V1: token budget with chunked prefill and
            mixed steps, ``n`` as child requests over the prefix cache, preemption by recompute only).
        scheduling_policy: V1's waiting-queue order and preemption victim, a name in
            ``SCHEDULING_POLICIES`` (``engine.request_queue``'s classes): "fcfs" (arrival order; the
            victim is the last admitted) or "priority" (lowest ``priority`` value first, then arrival; the
            victim is the highest (priority, arrival)). Paper semantics: "fcfs" only.
        kv_events_endpoint: publish every step's KV cache events (``StepRecord.kv_events``) in vLLM's
            schema and ZMQ framing on this endpoint (bound: ``tcp://127.0.0.1:5557``, ``tcp://*:5557``,
            ``ipc:///path``; port 0 picks a free one), as vLLM's ``--kv-events-config`` does
            (``engine/kv_publisher.py``). None: no publishing. Paged allocator only.
        kv_events_replay_endpoint: the ROUTER socket that answers replay requests (needs
            ``kv_events_endpoint``).
        kv_events_topic: the first frame of every message (vLLM's default "").
        kv_events_data_parallel_rank: the rank written into every published batch (vLLM's
            ``data_parallel_rank``; a lab engine standing in for one rank of a data-parallel server).
        num_threads: torch's intra-op threads for this process, set when the engine is built. None: the
            caller's choice if it made one (``OMP_NUM_THREADS``, ``torch.set_num_threads`` before the engine,
            ``engine.threads.configure_threads``), else the engine chooses as vLLM's CPU backend does
            (``engine.threads.engine_threads``: the cores of one NUMA node less one, and no more than are free).

    Raises:
        ValueError: a field is out of range, naming the field and the value.
    """

    model: str = EMBEDDED_MODEL
    block_size: int = 16
    num_blocks: int | None = None
    kv_budget_bytes: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    device: str = "auto"
    dtype: str | None = None
    attention_backend: str = "auto"
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    swap_space_blocks: int | None = None
    allocator: str = "paged"
    reservation_tokens: int | None = None
    contiguous_policy: str = "max"
    watermark: float | None = None
    semantics: str = "paper"
    scheduling_policy: str = "fcfs"
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_events_data_parallel_rank: int = 0
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.semantics not in SEMANTICS:
            raise ValueError(f"semantics must be one of {SEMANTICS}, got {self.semantics!r}")
        if self.scheduling_policy not in REQUEST_QUEUES:  # the registry itself: a policy registered later counts
            raise ValueError(f"scheduling_policy must be one of {tuple(REQUEST_QUEUES)}, got {self.scheduling_policy!r}")
        if self.watermark is None:
            self.watermark = DEFAULT_WATERMARK[self.semantics]
        if not isinstance(self.model, str) or not self.model.strip():
            raise ValueError(f"model must be a local path or hub id, got {self.model!r}")
        _check_positive_int("block_size", self.block_size)
        _check_positive_int("num_blocks", self.num_blocks, allow_none=True)
        _check_positive_int("kv_budget_bytes", self.kv_budget_bytes, allow_none=True)
        _check_positive_int("max_model_len", self.max_model_len, allow_none=True)
        _check_positive_int("max_num_seqs", self.max_num_seqs)
        _check_positive_int("max_num_batched_tokens", self.max_num_batched_tokens, allow_none=True)
        _check_positive_int("num_threads", self.num_threads, allow_none=True)
        if self.num_blocks is not None and self.kv_budget_bytes is not None:
            raise ValueError(
                f"give num_blocks ({self.num_blocks}) or kv_budget_bytes ({self.kv_budget_bytes}), not both"
            )
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be None or one of {DTYPES}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.swap_space_blocks is not None and (
                isinstance(self.swap_space_blocks, bool) or not isinstance(self.swap_space_blocks, int)
                or self.swap_space_blocks < 0):
            raise ValueError(f"swap_space_blocks must be an integer >= 0, got {self.swap_space_blocks!r}")
        if self.allocator not in ALLOCATORS:
            raise ValueError(f"allocator must be one of {ALLOCATORS}, got {self.allocator!r}")
        _check_positive_int("reservation_tokens", self.reservation_tokens, allow_none=True)
        if self.contiguous_policy not in CONTIGUOUS_POLICIES:
            raise ValueError(f"contiguous_policy must be one of {CONTIGUOUS_POLICIES}, got {self.contiguous_policy!r}")
        if (isinstance(self.watermark, bool) or not isinstance(self.watermark, (int, float))
                or not 0 <= self.watermark < 1):
            raise ValueError(f"watermark must be a number in [0, 1), got {self.watermark!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        self._check_semantics()
        self._check_kv_events()

    def _check_kv_events(self) -> None:
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            if getattr(self, name) is not None:
                check_endpoint(getattr(self, name), name, bind=True)
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError(f"kv_events_replay_endpoint {self.kv_events_replay_endpoint!r} needs a "
                             f"kv_events_endpoint to publish on")
        if self.kv_events_endpoint is not None and self.allocator != "paged":
            raise ValueError(f"kv_events_endpoint {self.kv_events_endpoint!r}: the {self.allocator} allocator has "
                             f"no prefix cache, so it has no KV cache events to publish")
        if (isinstance(self.kv_events_data_parallel_rank, bool) or not isinstance(self.kv_events_data_parallel_rank, int)
                or self.kv_events_data_parallel_rank < 0):
            raise ValueError(f"kv_events_data_parallel_rank must be an integer >= 0, got "
                             f"{self.kv_events_data_parallel_rank!r}")
        if not isinstance(self.kv_events_topic, str):
            raise ValueError(f"kv_events_topic must be a string, got {self.kv_events_topic!r}")

    def _check_semantics(self) -> None:
        """What one semantics has and the other lacks, refused by name."""
        if self.semantics == "v1":
            if self.preemption_mode != "recompute":
                raise ValueError(f"preemption_mode {self.preemption_mode!r}: vLLM V1 preempts by recompute only "
                                 f"(semantics='v1'); swap is the paper's (semantics='paper')")
            if self.swap_space_blocks:
                raise ValueError(f"swap_space_blocks {self.swap_space_blocks}: vLLM V1 has no swap pool "
                                 f"(semantics='v1')")
            if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
                raise ValueError(f"max_num_batched_tokens {self.max_num_batched_tokens} must be at least max_num_seqs "
                                 f"{self.max_num_seqs} (vLLM V1's SchedulerConfig: every running request gets a "
                                 f"token each step); lower max_num_seqs or raise the budget")
            if self.allocator != "paged":
                raise ValueError(f"allocator {self.allocator!r}: the contiguous baseline runs the paper's "
                                 f"scheduler (semantics='paper')")
        elif self.scheduling_policy != PAPER_SCHEDULING_POLICY:
            raise ValueError(f"scheduling_policy {self.scheduling_policy!r} needs semantics='v1'; the paper's "
                             f"scheduler is first come, first served")


@dataclass
class SamplingParams:
    """How one request's tokens are chosen (vLLM's names and defaults).

    Attributes:
        max_tokens: most tokens to generate (>= 1).
        temperature: 0 means greedy (argmax); > 0 divides the logits before softmax. Below
            ``SamplingParams.SAMPLING_EPS`` (1e-5) it is greedy too, as in vLLM (``_SAMPLING_EPS`` in
            vllm/sampling_params.py): dividing by a tinier temperature overflows the logits to inf/nan.
        top_p: nucleus sampling, keep the smallest set of tokens whose probability sums to >= top_p; in (0, 1].
        top_k: keep the k most likely tokens; -1 (or 0) keeps all.
        seed: seed of this request's own random stream; None draws one. Sample ``i`` of ``n`` uses seed + i.
        ignore_eos: keep generating past the end-of-sequence token (True or False).
        stop_token_ids: token ids that end the reply like the end-of-sequence token (vLLM's name); the
            stop token is the reply's last token, finish reason "stop".
        n: parallel sampling, ``n`` completions of one prompt that share the prompt's KV blocks; at most
            ``MAX_N_SEQUENCES`` (vLLM's cap), as is ``beam_width``.
        beam_width: beam search with this many beams (1: off). Deterministic like transformers'
            ``generate(num_beams=w, do_sample=False, early_stopping=False)``: temperature, top_p and top_k
            do not apply to it.
        length_penalty: beam search score = sum of log-probabilities / generated_length ** length_penalty.

    Raises:
        ValueError: a field is out of range, naming the field and the value.
    """

    SAMPLING_EPS = 1e-5  # a class constant, not a field: temperatures below it are greedy (vLLM's value)

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    ignore_eos: bool = False
    n: int = 1
    beam_width: int = 1
    length_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check_positive_int("max_tokens", self.max_tokens)
        if (isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float))
                or not math.isfinite(self.temperature) or self.temperature < 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (all) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < MAX_SEED):
            raise ValueError(f"seed must be None or an integer in [0, 2**62), got {self.seed!r}")
        _check_positive_int("n", self.n)
        _check_positive_int("beam_width", self.beam_width)
        for name in ("n", "beam_width"):
            if getattr(self, name) > MAX_N_SEQUENCES:
                raise ValueError(f"{name} must be at most {MAX_N_SEQUENCES:,} (vLLM's VLLM_MAX_N_SEQUENCES), "
                                 f"got {getattr(self, name):,}")
        if self.n > 1 and self.beam_width > 1:
            raise ValueError(f"use n ({self.n}) or beam_width ({self.beam_width}), not both")
        if (isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, (int, float))
                or not math.isfinite(self.length_penalty)):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or any(
                isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids (integers >= 0), got {self.stop_token_ids!r}")
        self.stop_token_ids = tuple(self.stop_token_ids)

    @property
    def num_seqs(self) -> int:
        """Sequences this request may hold at once."""
        return max(self.n, self.beam_width)

    @property
    def length_known(self) -> bool:
        """Whether the final length is known before generating: prompt + max_tokens (capped at the maximum
        length), since neither the end-of-sequence token nor a stop token can end the reply early."""
        return self.ignore_eos and not self.stop_token_ids

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature below ``SAMPLING_EPS`` (0 included)."""
        return self.temperature < self.SAMPLING_EPS

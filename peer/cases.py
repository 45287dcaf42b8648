"""The conformance cases: the same requests and settings run through vLLM and through the lab in V1 mode.

Plain data (no torch, no vLLM), so both sides read the same cases: ``build_cases(tokenize)`` returns
the spec ``peer/vllm_driver.py`` takes (``{"name", "block_size", "num_gpu_blocks", ..., "requests"}``),
with prompts as token ids of the embedded model's tokenizer. ``num_gpu_blocks`` is vLLM's pool, which
includes its reserved null block (``BlockPool.null_block``, block 0); the lab's pool is one block smaller,
so both have the same usable blocks.

Each case names what it checks and, where vLLM and the lab differ on purpose, why (``known_difference``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# Public-domain text (Hamlet, III.1; Julius Caesar, III.2) cut into prompts of exact token lengths.
TEXT = (
    "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer The slings and "
    "arrows of outrageous fortune, Or to take arms against a sea of troubles And by opposing end them. To "
    "die, to sleep; No more; and by a sleep to say we end The heart-ache and the thousand natural shocks "
    "That flesh is heir to: 'tis a consummation Devoutly to be wish'd. To die, to sleep; To sleep, perchance "
    "to dream, ay, there's the rub: For in that sleep of death what dreams may come, When we have shuffled "
    "off this mortal coil, Must give us pause. Friends, Romans, countrymen, lend me your ears; I come to "
    "bury Caesar, not to praise him. The evil that men do lives after them; The good is oft interred with "
    "their bones; So let it be with Caesar. The noble Brutus Hath told you Caesar was ambitious: If it were "
    "so, it was a grievous fault, And grievously hath Caesar answer'd it. Here, under leave of Brutus and "
    "the rest, For Brutus is an honourable man; So are they all, all honourable men, Come I to speak in "
    "Caesar's funeral. He was my friend, faithful and just to me: But Brutus says he was ambitious; And "
    "Brutus is an honourable man. He hath brought many captives home to Rome Whose ransoms did the general "
    "coffers fill: Did this in Caesar seem ambitious? When that the poor have cried, Caesar hath wept: "
    "Ambition should be made of sterner stuff: Yet Brutus says he was ambitious; And Brutus is an "
    "honourable man. You all did see that on the Lupercal I thrice presented him a kingly crown, Which he "
    "did thrice refuse: was this ambition?"
)


@dataclass
class CaseRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    ignore_eos: bool = True
    n: int = 1
    priority: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    arrival_step: int = 0  # added after this many engine steps ran (0: before the first)


@dataclass
class Case:
    name: str
    what: str  # the one behaviour this case checks
    block_size: int
    num_gpu_blocks: int  # vLLM's pool, null block included; the lab gets num_gpu_blocks - 1
    requests: list[CaseRequest]
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    max_model_len: int = 512
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    seed: int = 0
    watermark: float = 0.0  # vLLM's SchedulerConfig.watermark; the lab's EngineConfig.watermark (V1: 0)
    known_difference: str = ""
    model: str = ""  # "": the embedded model (engine.EMBEDDED_MODEL); "hybrid": assets/tiny_hybrid_model

    @property
    def lab_num_blocks(self) -> int:
        return self.num_gpu_blocks - 1

    def spec(self) -> dict:
        """The case as ``peer/vllm_driver.py`` reads it."""
        d = asdict(self)
        for key in ("what", "known_difference", "model"):
            d.pop(key)
        return d


_SUBSTITUTION = ("vLLM 0.32 refuses n > 1 at temperature 0 ('n must be 1 when using greedy sampling'); the "
                 "driver sends temperature 1 with top_k 1 (no seed), which is greedy")


def build_cases(tokenize, vocab_size: int = 2048) -> list[Case]:
    """Every case at block sizes 32 and 64. ``tokenize(text) -> list[int]`` is the model's tokenizer;
    ``vocab_size``: the model's (the embedded model's 2,048 by default), for a request whose every token
    is a stop token."""
    ids = tokenize(TEXT)
    assert len(ids) >= 480, f"the case text encodes to {len(ids)} tokens, fewer than the 480 the cases cut"
    cases = []
    for B in (32, 64):
        cases += _cases_at(B, ids, vocab_size)
    return cases


def _cases_at(B: int, ids: list[int], vocab_size: int) -> list[Case]:
    system = ids[: 2 * B + B // 4]  # a system prompt of 2.25 blocks
    tails = [ids[300 + 13 * i: 300 + 13 * i + 5 + 7 * i] for i in range(6)]
    k_blocks = ids[: 3 * B]  # exactly 3 blocks
    long_prompt = ids[: 9 * B // 2 + 7]  # 4.5 blocks + 7 tokens: longer than the 2-block budget below
    s = f"B{B}"
    cases = [
        Case(f"shared-system-prompt-{s}", "6 requests sharing a 2.25-block system prompt, admitted together",
             B, 40, [CaseRequest(f"r{i}", system + t, max_tokens=8) for i, t in enumerate(tails)]),
        Case(f"exact-k-blocks-repeated-{s}",
             "a prompt of exactly 3 blocks, sent again after the first finished and a third time while the "
             "second runs: the last-token rule caps the hit at 2 blocks",
             B, 40, [CaseRequest("first", k_blocks, max_tokens=4),
                     CaseRequest("again", k_blocks, max_tokens=4, arrival_step=6),
                     CaseRequest("third", k_blocks, max_tokens=4, arrival_step=7)]),
        Case(f"identical-prompts-one-step-{s}", "4 identical prompts added before the same step",
             B, 40, [CaseRequest(f"same{i}", system + tails[0], max_tokens=6) for i in range(4)]),
        Case(f"preemption-{s}", "a pool too small for 4 growing requests: recompute preemption, and "
             "re-admission hitting its own freed blocks",
             B, 9, [CaseRequest(f"p{i}", ids[40 * i: 40 * i + B + 5], max_tokens=2 * B) for i in range(4)],
             max_model_len=4 * B),
        Case(f"parallel-n4-{s}", "n = 4 at temperature 0: four child requests over the prefix cache",
             B, 40, [CaseRequest("par", system + tails[1], max_tokens=6, n=4)],
             known_difference=_SUBSTITUTION),
        Case(f"priority-{s}", "priority policy under memory pressure: a late high-priority request and the "
             "victim chosen by (priority, arrival)",
             B, 9, [CaseRequest("low0", ids[0: B + 3], max_tokens=2 * B, priority=2),
                    CaseRequest("low1", ids[50: 50 + B + 3], max_tokens=2 * B, priority=1),
                    CaseRequest("mid", ids[100: 100 + B + 3], max_tokens=2 * B, priority=1),
                    CaseRequest("high", ids[150: 150 + B + 3], max_tokens=B, priority=0, arrival_step=3)],
             scheduling_policy="priority", max_model_len=4 * B),
        Case(f"priority-children-{s}", "priority policy with n = 3 children sharing their parent's arrival: "
             "ties among children go by request id in the waiting queue and to the first in running order "
             "as victim",
             B, 9, [CaseRequest("kids", ids[200: 200 + B + 9], max_tokens=2 * B, n=3, priority=1),
                    CaseRequest("solo", ids[260: 260 + B // 2], max_tokens=B, priority=1)],
             scheduling_policy="priority", max_model_len=4 * B,
             known_difference=_SUBSTITUTION),
        Case(f"chunked-prefill-{s}", "prompts longer than the token budget (2 blocks) prefilled in chunks, "
             "mixed with decode tokens of a running request",
             B, 40, [CaseRequest("short", ids[450: 470], max_tokens=12),
                     CaseRequest("long", long_prompt, max_tokens=6, arrival_step=1),
                     CaseRequest("long2", long_prompt[: 3 * B + 1], max_tokens=4, arrival_step=2)],
             max_num_batched_tokens=2 * B),
        Case(f"parallel-n3-chunked-{s}", "n = 3 at temperature 0 with a prompt longer than the token budget "
             "(2 blocks): each child is prefilled in chunks (partial prefills sample nothing), later children "
             "hit the blocks earlier ones stored, mixed with decode tokens of a running request",
             B, 40, [CaseRequest("short", ids[450: 470], max_tokens=12),
                     CaseRequest("kids", long_prompt, max_tokens=5, n=3, arrival_step=1)],
             max_num_batched_tokens=2 * B, known_difference=_SUBSTITUTION),
        Case(f"watermark-{s}", "watermark 0.25 (int(0.25 x 9) = 2 blocks kept free while a request runs): "
             "the third request, whose 2 blocks fit the 2 free ones, waits until the first finishes",
             B, 9, [CaseRequest("a", ids[0: 2 * B + 5], max_tokens=B // 2),
                    CaseRequest("b", ids[2 * B + 8: 4 * B + 13], max_tokens=B // 2 + 4),
                    CaseRequest("c", ids[4 * B + 16: 5 * B + 21], max_tokens=4)],
             max_model_len=4 * B, watermark=0.25),
        Case(f"finish-reasons-{s}", "finish and stop reasons: stop tokens (stop_reason = the token), the "
             "length limit with and without ignore_eos, and a stop token sampled as the max_tokens-th token "
             "(every token id a stop token, max_tokens 1: check_stop tests stop tokens before the length)",
             B, 40, [CaseRequest("stop-dot", ids[100: 140], max_tokens=30, stop_token_ids=[14]),
                     CaseRequest("stop-either", ids[0: 40], max_tokens=30, stop_token_ids=[45, 14]),
                     CaseRequest("length", ids[450: 470], max_tokens=8, stop_token_ids=[vocab_size - 1]),
                     CaseRequest("eos-on", ids[200: 230], max_tokens=8, ignore_eos=False),
                     CaseRequest("stop-at-limit", ids[300: 330], max_tokens=1,
                                 stop_token_ids=list(range(vocab_size)))]),
    ]
    if B == 32:  # the lab's slowest kind of case (a hundred steps and more): at one block size only
        cases.append(Case(
            f"preemption-watermark-{s}", "recompute preemption under a watermark of 0.2 (int(0.2 x 9) = 1 "
            "block): the fourth request, whose 2 blocks fit the 2 free ones, waits at the start; one preemption "
            "instead of two; the preempted request re-admitted with the waiting one",
            B, 9, [CaseRequest(f"p{i}", ids[40 * i: 40 * i + B + 5], max_tokens=2 * B) for i in range(4)],
            max_model_len=4 * B, watermark=0.2))
    return cases


# ---- the hybrid model (issue 25): sliding-window and full-attention layers in two KV cache groups ----------

HYBRID_WINDOW = 48  # its config.json "sliding_window": layers 0 and 2 attend to the last 48 tokens


def min_num_gpu_blocks(block_size: int, max_model_len: int, max_num_batched_tokens: int,
                       sliding_window: int | None = None) -> int:
    """The smallest ``num_gpu_blocks_override`` vLLM 0.32 accepts: its pool (null block included) must hold
    one ``max_model_len`` request in every KV cache group at once, all groups drawing from the one pool.

    vLLM's ``get_kv_cache_configs`` (vllm/v1/core/kv_cache_utils.py:2611-2640) turns the override into
    ``override x bytes_per_block`` of memory, keeps one block back for the null block, and
    ``_check_enough_kv_cache_memory`` needs ``_max_memory_usage_bytes_from_groups`` (lines 2337-2366):
    ``bytes_per_block x`` the sum over groups of each group's blocks. ``bytes_per_block`` is the page of the
    largest group (``_get_kv_cache_bytes_per_block``, line 1520: both groups of the hybrid model have two
    layers, so one page spans one block of every layer of a group, and block id b names block b in each
    group's own tensors). A full-attention group takes ``ceil(max_model_len / B)`` blocks
    (``AttentionSpec.max_memory_usage_bytes``, vllm/v1/kv_cache_interface.py:602-607); a sliding-window
    group ``ceil(min(window - 1 + max_in_flight_tokens, max_model_len) / B) + 1``
    (``SlidingWindowSpec.max_admission_blocks_per_request``, lines 859-885), where
    ``max_in_flight_tokens`` is ``max_num_batched_tokens`` with synchronous scheduling
    (``VllmConfig.max_in_flight_tokens``, vllm/config/vllm.py:590-597). So a block of
    ``num_gpu_blocks`` is one block of the shared pool that either group may take, not a block per group;
    the lab's pool (``num_gpu_blocks - 1`` blocks, ``EngineConfig.num_blocks``) is the same shared pool.
    """
    full = -(-max_model_len // block_size)
    if sliding_window is None:
        return full + 1
    sliding = -(-min(sliding_window - 1 + max_num_batched_tokens, max_model_len) // block_size) + 1
    return full + sliding + 1


def _hybrid(name: str, what: str, B: int, num_gpu_blocks: int, requests: list[CaseRequest], **kw) -> Case:
    case = Case(name, what, B, num_gpu_blocks, requests, model="hybrid", **kw)
    need = min_num_gpu_blocks(B, case.max_model_len, case.max_num_batched_tokens, HYBRID_WINDOW)
    if num_gpu_blocks < need:
        raise ValueError(f"hybrid case {name}: num_gpu_blocks {num_gpu_blocks} is below the {need} vLLM needs for "
                         f"max_model_len {case.max_model_len} in both KV cache groups (min_num_gpu_blocks)")
    return case


def build_hybrid_cases(tokenize) -> list[Case]:
    """The cases on the hybrid model (``engine.EMBEDDED_HYBRID_MODEL``: layers 0 and 2 a 48-token sliding window, 1 and 3
    full attention), at block size 32 (the smallest vLLM's CPU attention takes), so the window is 1.5
    blocks and a sliding layer's prefix hit needs the ``ceil((48 - 1) / 32) = 2`` blocks before the hit
    point. ``tokenize(text) -> list[int]`` is the model's tokenizer (the embedded model's)."""
    ids = tokenize(TEXT)
    assert len(ids) >= 480, f"the case text encodes to {len(ids)} tokens, fewer than the 480 the cases cut"
    B = 32
    s = f"B{B}"
    prompt = ids[:150]  # 4 full blocks + 22 tokens: about 3 windows
    fork = ids[:100] + ids[300:340]  # shares 3 full blocks (96 tokens) with prompt, then differs
    return [
        _hybrid(f"hybrid-long-prompts-{s}",
                "two prompts of 4 and 5 windows decoding past them: the sliding group frees each block that "
                "leaves the window (its table gets the null block) while the full group keeps every block",
                B, 40, [CaseRequest("four", ids[:192], max_tokens=24),
                        CaseRequest("five", ids[250:490], max_tokens=24)], max_model_len=320),
        _hybrid(f"hybrid-repeated-prompt-{s}",
                "a 150-token prompt sent again after it finished (the sliding group keeps the 2 blocks before "
                "the hit point: 128 tokens hit) and a prompt sharing its first 100 tokens (3 full blocks the "
                "full group holds, but the sliding group cached no 2 blocks ending there)",
                B, 24, [CaseRequest("first", prompt, max_tokens=4),
                        CaseRequest("again", prompt, max_tokens=4, arrival_step=6),
                        CaseRequest("fork", fork, max_tokens=4, arrival_step=12)], max_model_len=192),
        _hybrid(f"hybrid-evict-sliding-{s}",
                "a small pool: the first request's cached sliding-window blocks, freed as the window passed, "
                "are evicted first (least recently freed) by a second prompt; the first prompt again then "
                "finds the full group's blocks but not the sliding ones it needs",
                B, 18, [CaseRequest("first", prompt, max_tokens=40),
                        CaseRequest("filler", ids[200:376], max_tokens=4, arrival_step=42),
                        CaseRequest("again", prompt, max_tokens=4, arrival_step=48)], max_model_len=192),
        _hybrid(f"hybrid-chunked-window-edge-{s}",
                "chunked prefill with a 40-token budget (chunks end at 39, 78, ... tokens, across the window's "
                "48-token edge and inside blocks) mixed with a decoding request, then a prompt sharing the "
                "long one's first 140 tokens (its 4 full blocks; the sliding group kept the 2 before them)",
                B, 24, [CaseRequest("short", ids[450:470], max_tokens=12),
                        CaseRequest("long", prompt, max_tokens=6, arrival_step=1),
                        CaseRequest("long2", ids[:140] + ids[400:420], max_tokens=4, arrival_step=9)],
                max_model_len=192, max_num_batched_tokens=40),
    ]

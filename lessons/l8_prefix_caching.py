"""Lesson 8: prefix caching in depth, in vLLM V1's semantics.

The practice drives the engine's ``BlockManager`` as vLLM V1's ``KVCacheManager`` does (``allocate_slots``;
``evict_uncached_first``: a finished request's blocks return tail first, those without a hash to the front
of the free queue), with blocks of 4 tokens, one word per token so a block can be read. Requests A..E run
one after another: chained hashes, the last-token rule, a duplicate block, eviction from the free queue.
The real-model part runs ``LLMEngine(semantics="v1")`` on four chat requests behind one system prompt:
once in a tight pool (preemptions: the honest hit rate against one that counts the re-admissions too)
and at three block sizes in a roomy pool.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from engine import SamplingParams
from engine.block_manager import NONE_HASH, BlockManager, block_hash
from engine.metrics import pct, prefix_cache_stats
from engine.records import plural
from engine.scenarios.presets import SYSTEM_PROMPT, exact_prompt
from lessons.common import run_engine
from lessons.exercise import Exercise, Slip

# ------------------------------------------------------------------------------------------- practice
BLOCK_SIZE, NUM_BLOCKS = 4, 8
S1 = "you are the chorus".split()
S1B = "you are a chorus".split()
S2 = "speak in plain verse".split()
S3 = "keep every answer short".split()
PROMPTS = {
    "A": S1 + S2 + S3 + ["who", "comes"],
    "B": S1B + S2 + S3 + ["what", "news"],
    "C": S1 + S2 + S3,
    "D": "now is the winter of our discontent made glorious summer by this sun of york".split(),
}
PROMPTS["E"] = list(PROMPTS["A"])
# What happens, in order: a request "runs" (its prompt is prefilled) or "finishes" (its blocks are freed).
# B and C are both running when they finish, in ``FINISH_ORDER``.
FINISH_ORDER = ("B", "C")


def _vocab() -> dict[str, int]:
    """Word -> token id (1, 2, ... in order of first use): the practice's tokens are words."""
    words: dict[str, int] = {}
    for prompt in PROMPTS.values():
        for w in prompt:
            words.setdefault(w, len(words) + 1)
    return words


VOCAB = _vocab()
WORD = {i: w for w, i in VOCAB.items()}


def ids(name: str) -> list[int]:
    return [VOCAB[w] for w in PROMPTS[name]]


def words(token_ids) -> str:
    return " ".join(WORD.get(t, "?") for t in token_ids)


@dataclass
class Stage:
    """The pool after one operation of the practice."""

    label: str
    request: str
    kind: str  # "run" or "finish"
    cached: int  # tokens found in the prefix cache (a run)
    computed: int  # prompt tokens the prefill computes (a run)
    tables: dict[str, list[int]]
    queue: list[int]  # the free queue, front (next handed out) first
    hashes: list[str | None]
    counts: list[int]
    events: list
    bm: BlockManager


def ops(finish_order=FINISH_ORDER) -> list[tuple[str, str]]:
    return [("run", "A"), ("finish", "A"), ("run", "B"), ("run", "C"), *(("finish", r) for r in finish_order),
            ("run", "D"), ("run", "E")]


def practice(finish_order=FINISH_ORDER) -> dict[str, Stage]:
    """Replay the practice on a fresh V1-style ``BlockManager``; stages keyed "A", "A done", "B", ..."""
    bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True, evict_uncached_first=True)
    stages: dict[str, Stage] = {}
    for kind, name in ops(finish_order):
        cached = computed = 0
        if kind == "run":
            tokens = ids(name)
            hit = len(bm.match_prefix(tokens)) * BLOCK_SIZE
            cached = bm.allocate_slots(name, tokens, len(tokens) - hit)
            computed = len(tokens) - cached
            label = f"{name}'s prefill"
        else:
            bm.free(name)
            label = f"{name} finishes"
        key = name if kind == "run" else f"{name} done"
        stages[key] = Stage(label, name, kind, cached, computed, copy.deepcopy(bm.block_tables),
                            list(bm.free_block_queue), list(bm.block_hashes), list(bm.ref_counts), bm.drain_events(),
                            copy.deepcopy(bm))
    return stages


def chain(token_ids: list[int]) -> list[str]:
    """The chained hash of each full block of ``token_ids`` (the engine's ``block_hash``)."""
    out, parent = [], NONE_HASH
    for i in range(len(token_ids) // BLOCK_SIZE):
        parent = block_hash(parent, token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
        out.append(parent)
    return out


def queue_after_frees(queue: list[int], tables: list[list[int]], counts: list[int], hashes: list,
                      tail_first: bool = True, uncached_first: bool = True) -> list[int]:
    """The free queue after the requests holding ``tables`` finish, one after another, worked out by hand:
    each table's blocks are released in order (``tail_first``: last block first, as vLLM V1), those that
    reach count 0 join the queue: at the back, or (``uncached_first``, V1's ``BlockPool.free_blocks``) the
    ones without a hash at the front. The lesson's wrong answers come from the other flags; the tests
    check that the default flags give the engine's own queue."""
    q, counts = list(queue), list(counts)
    for table in tables:
        freed = []
        for b in (reversed(table) if tail_first else table):
            counts[b] -= 1
            if counts[b] == 0:
                freed.append(b)
        if uncached_first:
            q = [b for b in freed if hashes[b] is None] + q + [b for b in freed if hashes[b] is not None]
        else:
            q = q + freed
    return q


def hash_rows(stage: Stage, name: str, lookup: bool = False) -> list[dict]:
    """One row per block of ``name``'s prompt: its words, its chained hash, and where it lives
    (``lookup``: whether the cache held that hash before this request ran)."""
    tokens = ids(name)
    hashes = chain(tokens)
    table = stage.tables.get(name, [])
    rows = []
    for i in range(-(-len(tokens) // BLOCK_SIZE)):
        h = hashes[i] if i < len(hashes) else None
        row = {"logical block": i, "tokens": words(tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]),
               "hash (parent's hash + these tokens)": h or "none: the block is not full",
               "physical block": table[i] if i < len(table) else "-"}
        if lookup:
            row["found in the cache?"] = ("yes" if i * BLOCK_SIZE < stage.cached else "no")
        rows.append(row)
    return rows


def hash_holders(stage: Stage) -> dict[str, list[int]]:
    """Hash -> the physical blocks that carry it (a duplicate has two)."""
    out: dict[str, list[int]] = {}
    for b, h in enumerate(stage.hashes):
        if h is not None:
            out.setdefault(h, []).append(b)
    return out


# ------------------------------------------------------------------------------------ the real model
CHAT_SHARED = 28  # tokens of the system prompt every request starts with
CHAT_OWN = 8  # tokens of each request's own question after it
CHAT_MAX_TOKENS = 16
CHAT_QUESTIONS = ["Who comes here tonight?", "Where is the king now?", "What news from France, my lord?",
                  "Is the queen well this winter?"]
TIGHT = {"block_size": 8, "num_blocks": 12}
SWEEP = (8, 16, 32)  # block sizes, each in a roomy pool
ROOMY_SLOTS = 512


def chat_requests(tokenizer) -> list[tuple[list[int], SamplingParams]]:
    """Four requests: the same ``CHAT_SHARED``-token system prompt, then ``CHAT_OWN`` tokens of their own;
    greedy, ``CHAT_MAX_TOKENS`` tokens each."""
    def tok(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    shared = exact_prompt(tok, SYSTEM_PROMPT, CHAT_SHARED)
    return [(shared + exact_prompt(tok, " " + q, CHAT_OWN),
             SamplingParams(max_tokens=CHAT_MAX_TOKENS, temperature=0.0, ignore_eos=True)) for q in CHAT_QUESTIONS]


def common_prefix(prompts: list[list[int]]) -> int:
    """Tokens every prompt starts with."""
    n = 0
    while all(len(p) > n and p[n] == prompts[0][n] for p in prompts):
        n += 1
    return n


def chat_run(loaded, block_size: int, num_blocks: int):
    """The four chat requests on the real model, vLLM V1 semantics, prefix caching on, no watermark."""
    requests = chat_requests(loaded[1])
    longest = max(len(p) + sp.max_tokens for p, sp in requests)
    return run_engine(loaded, requests, label=f"four chats, blocks of {block_size}", semantics="v1",
                      block_size=block_size, num_blocks=num_blocks, max_model_len=longest, watermark=0.0,
                      enable_prefix_caching=True)


def tight_run(loaded):
    return chat_run(loaded, TIGHT["block_size"], TIGHT["num_blocks"])


def roomy_run(loaded, block_size: int):
    return chat_run(loaded, block_size, ROOMY_SLOTS // block_size)


def run_stats(run) -> dict:
    """``engine.metrics.prefix_cache_stats`` of a run's last step, plus the rate with re-admissions mixed in."""
    s = prefix_cache_stats(run.records[-1].snapshot.prefix_cache)
    s["mixed_rate_pct"] = round(pct(s["hit_tokens"] + s["readmission_hit_tokens"],
                                    s["query_tokens"] + s["readmission_query_tokens"]), 2)
    s["readmission_rate_pct"] = round(pct(s["readmission_hit_tokens"], s["readmission_query_tokens"]), 2)
    return s


def first_hits(run) -> dict[str, int]:
    """Request -> tokens found in the cache at its first admission (from the records' prefix_hit events)."""
    hits = {r: 0 for r in run.request_ids}
    seen = set()
    for rec in run.records:
        for e in rec.events:
            if e.kind == "admit":
                seen.add(e.request_id)
            if e.kind == "prefix_hit" and not e.data["readmission"]:
                hits[e.request_id] += e.data["num_tokens"]
    return hits


def readmissions(run) -> list[dict]:
    """Every re-admission after a preemption, in order: who, at which step, the tokens it queried and found."""
    out = []
    for rec in run.records:
        for e in rec.events:
            if e.kind == "admit" and e.data["readmission"]:
                hit = next((h.data["num_tokens"] for h in rec.events
                            if h.kind == "prefix_hit" and h.request_id == e.request_id and h.data["readmission"]), 0)
                out.append({"request": e.request_id, "step": rec.step, "tokens": e.data["num_tokens"], "hit": hit})
    return out


def who_came_back(run) -> str:
    """"R3" / "R4 and R3": the re-admitted requests, in the order they came back."""
    names = list(dict.fromkeys(r["request"] for r in readmissions(run)))
    return " and ".join(names) if names else "nobody"


def sweep(ctx) -> dict[int, dict]:
    """Block size -> the roomy run's prefix-cache figures."""
    out = {}
    for B in SWEEP:
        run = ctx.run(roomy_run, B)
        s = run_stats(run)
        hits = first_hits(run)
        out[B] = {"rate": s["hit_rate_pct"], "hit_tokens": s["hit_tokens"], "query_tokens": s["query_tokens"],
                  "per_later": hits[run.request_ids[1]], "blocks_after_prefill": run.records[0].snapshot.num_used_blocks,
                  "preemptions": len(run.events("preempt"))}
    return out


def _pct(x: float) -> str:
    return f"{x:.1f}%".replace(".0%", "%")


# -------------------------------------------------------------------------------------------- lesson
def facts(ctx) -> dict:
    st = practice()
    a, c = st["A"], st["C"]
    tokenizer = ctx.loaded[1]
    requests = chat_requests(tokenizer)
    prompts = [p for p, _ in requests]
    tight = ctx.run(tight_run)
    s = run_stats(tight)
    sw = sweep(ctx)
    before_finish = st["C"]
    return {
        "block_size": BLOCK_SIZE, "num_blocks": NUM_BLOCKS, "last_block": NUM_BLOCKS - 1,
        "a_prompt": words(ids("A")), "a_len": len(ids("A")), "a_table": str(a.tables["A"]),
        "a_full": len(chain(ids("A"))),
        "a_queue": ", ".join(map(str, st["A done"].queue)),
        "b_prompt": words(ids("B")), "b_len": len(ids("B")),
        "c_prompt": words(ids("C")), "c_len": len(ids("C")),
        "c_recomputed": c.tables["C"][-1],
        "queue_phrase": (f"holds only block {before_finish.queue[0]}" if len(before_finish.queue) == 1 else
                         "is " + ", ".join(map(str, before_finish.queue)) + " (front first)"),
        "b_table": str(before_finish.tables["B"]), "c_table": str(before_finish.tables["C"]),
        "d_prompt": words(ids("D")), "d_len": len(ids("D")), "d_blocks": -(-len(ids("D")) // BLOCK_SIZE),
        "first_done": FINISH_ORDER[0], "second_done": FINISH_ORDER[1],
        "e_len": len(ids("E")),
        "chat_n": len(requests), "chat_prompt": len(prompts[0]), "chat_shared": common_prefix(prompts),
        "chat_tokens": CHAT_MAX_TOKENS, "tight_bs": TIGHT["block_size"], "tight_blocks": TIGHT["num_blocks"],
        "preempt_phrase": plural(len(tight.events("preempt")), "preemption"),
        "victims": who_came_back(tight),
        "honest_rate": _pct(s["hit_rate_pct"]), "mixed_rate": _pct(s["mixed_rate_pct"]),
        "sweep_sizes": ", ".join(map(str, SWEEP)), "roomy_slots": ROOMY_SLOTS,
        "best_bs": min(sw, key=lambda b: (-sw[b]["rate"], b)), "best_rate": _pct(max(v["rate"] for v in sw.values())),
        "zero_sizes": " and ".join(str(b) for b in SWEEP if sw[b]["rate"] == 0) or "none",
    }


RECAP = [
    "A block's hash covers its parent's hash and its own tokens, so a block is found only when everything "
    "before it matches too.",
    "Only full blocks are cached, and the block holding the last prompt token is always computed again: a "
    "prompt that is entirely in the cache still recomputes its last block.",
    "Freed blocks keep their hash in the free queue; vLLM V1 reuses blocks without a hash first, then the "
    "least recently freed, and frees a request's blocks tail first, so shared prefixes survive longest.",
    "A hit rate that counts re-admitted requests finding their own freed blocks overstates sharing: the "
    "lesson's run reports {{ honest_rate }} honestly, {{ mixed_rate }} with the re-admissions mixed in.",
    "Hits come in whole blocks, so bigger blocks lose more of a shared prefix: in the sweep, blocks of "
    "{{ best_bs }} gave the best hit rate ({{ best_rate }}).",
]


def exercises(ctx) -> dict[str, Exercise]:
    st = practice()
    B = BLOCK_SIZE

    # 1. chained hashes: B's first block differs from A's, its next two blocks have A's very words
    b_stage = st["B"]
    b_tokens = ids("B")
    cached_blocks_before = {tuple(ids("A")[i * B:(i + 1) * B]) for i in range(len(chain(ids("A"))))}
    looked_up = range((len(b_tokens) - 1) // B)  # the blocks the lookup considers (never the last token's)
    same_words = [i for i in looked_up if tuple(b_tokens[i * B:(i + 1) * B]) in cached_blocks_before]
    own_match = B * len(same_words)
    first_diff = next(i for i in looked_up if i not in same_words)
    same_tokens = common_prefix([ids("A"), b_tokens])
    chain_hit = Exercise(
        "chain_hit", f"B's prompt: *{words(b_tokens)}* ({len(b_tokens)} tokens). A has finished; its blocks sit "
        "free in the cache with their hashes. How many of B's prompt tokens does the prefix cache find?", "number",
        b_stage.cached, unit="tokens",
        slips=[Slip("block-alone", own_match, f"That counts every block whose own {B} words A also had (B's "
                    f"{_and(ORDINALS[i] for i in same_words)} block{'s' if len(same_words) > 1 else ''}). But a "
                    f"block's hash also covers its parent's hash: B's {ORDINALS[first_diff]} block differs from "
                    f"A's, so every hash after it in B's chain differs too, even for blocks of A's very words."),
               Slip("token-prefix", same_tokens, "That is the run of equal *tokens* at the start. The cache "
                    "finds whole blocks: a block whose words differ anywhere is simply a different block.")],
        explanation=("B's first block differs from A's by one word, so its hash differs; every later hash in B's "
                     "chain starts from that one, so none of them is A's either, even for blocks of the very "
                     f"same words. B's prefill took fresh blocks {b_stage.tables['B']}."))

    # 2. the last-token rule: C's prompt is A's three full blocks, all cached
    c_stage = st["C"]
    c_len = len(ids("C"))
    last_token = Exercise(
        "last_token", f"C's prompt is exactly A's first {c_len} tokens: *{words(ids('C'))}*, {c_len // B} full "
        f"blocks whose hashes are all in the cache now. How many of C's prompt tokens does the model compute "
        "in C's prefill?", "number", c_stage.computed, unit="tokens",
        slips=[Slip("all-cached", 0, "Nothing computed would leave the model without the last prompt token's "
                    "output, and it needs that token's logits to sample C's first reply token. The lookup "
                    "stops before the block holding the last prompt token."),
               Slip("one-token", 1, "The last token must be computed, right; but hits come in whole blocks, so "
                    "the lookup gives up the whole block holding it, and all its tokens are computed."),
               Slip("no-hit", c_len, "The cache does find C's blocks: hashes depend only on the tokens, not on "
                    "which request computed them."),
               Slip("cached-not-computed", c_stage.cached, "That is what the cache found; the question asks "
                    "what is left to compute.")],
        explanation=(f"The engine found {c_stage.cached} tokens and computed {c_stage.computed}: the lookup only "
                     f"considers the first {c_len - 1} tokens (all but the last), which cover "
                     f"{(c_len - 1) // B} full blocks. C's last block is computed again, into block "
                     f"{c_stage.tables['C'][-1]}."))

    # 3. duplicates: C's recomputed block carries the hash of A's cached block
    holders = hash_holders(c_stage)
    c_last = c_stage.tables["C"][-1]
    dup_hash = c_stage.hashes[c_last]
    twin = [b for b in holders.get(dup_hash, []) if b != c_last]
    twin_block = twin[0] if twin else st["A"].tables["A"][c_len // B - 1]
    dup_options = {
        "two": f"both block {twin_block} and block {c_last} carry that hash, and the cache keeps both",
        "swap": f"C's table is pointed at block {twin_block}, and block {c_last} goes back to the free queue",
        "evict": f"block {twin_block} loses its hash, so the cache holds one copy: block {c_last}",
        "nohash": f"block {c_last} gets no hash, since block {twin_block} already has it",
    }
    if len(twin) >= 1 and dup_hash in c_stage.bm.cached_blocks and len(c_stage.bm.cached_blocks[dup_hash]) == 2:
        dup_answer = "two"
    elif twin_block in c_stage.tables["C"]:
        dup_answer = "swap"
    elif c_stage.hashes[twin_block] is None:
        dup_answer = "evict"
    else:
        dup_answer = "nohash"
    dup_messages = {
        "two": "Both blocks are cached under one hash; either can serve a later hit.",
        "swap": "A block table only grows: vLLM never repoints an entry that already holds computed K/V, so "
                "the copy stays where it was written.",
        "evict": "A cached block loses its hash only when the free queue hands it out again; having a twin does "
                 "not evict it.",
        "nohash": "Every full block gets its hash when it is filled; the cache maps one hash to all the blocks "
                  "that carry it.",
    }
    order = ["swap", "two", "nohash", "evict"]
    duplicate = Exercise(
        "duplicate", f"C's last block (block {c_last}) holds the same words after the same prefix as block "
        f"{twin_block}, which A filled and which still sits free in the cache. What does the pool hold right after "
        "C's prefill?", "choice", dup_options[dup_answer], options=[dup_options[k] for k in order],
        slips=[Slip(k, dup_options[k], dup_messages[k]) for k in order if k != dup_answer],
        explanation=(f"Hash {dup_hash} is now carried by blocks {holders.get(dup_hash)}. Block tables are "
                     "append-only (vLLM's design notes say so, and keep such duplicates): two physical blocks "
                     "hold the same content until one of them is evicted."),
        # A sentence that says how many copies the cache keeps settles the question, rightly or (like the
        # README's old "stores its full blocks once") wrongly.
        answer_phrases=[dup_options[dup_answer]] + (["the cache keeps both", "keeps such duplicates",
                                                     "duplicates are kept", "stores its full blocks once",
                                                     "stored only once"] if dup_answer == "two" else []))

    # 4. eviction: B and C finish, D (nothing in common) takes 4 blocks from the free queue
    before = st["C"]
    d_stage = st["D"]
    d_table = d_stage.tables["D"]
    d_need = len(d_table)
    finished_tables = [before.tables[r] for r in FINISH_ORDER]
    real_queue = st[f"{FINISH_ORDER[-1]} done"].queue
    head_first = queue_after_frees(before.queue, finished_tables, before.counts, before.hashes, tail_first=False)
    paper = queue_after_frees(before.queue, finished_tables, before.counts, before.hashes, uncached_first=False)
    evicted = [e.blocks[0] for e in d_stage.events if e.kind == "evict"]
    # the partly filled last blocks the finished requests freed: no hash, so V1 puts them at the front
    unhashed = [b for t in finished_tables for b in t if before.hashes[b] is None and b not in before.queue]
    no_exception = [b for b in real_queue if b not in unhashed]  # as if they were not freed, or joined last
    evict_table = Exercise(
        "evict_table", f"You are the block pool. {FINISH_ORDER[0]} finishes, then {FINISH_ORDER[1]}. Then D "
        f"arrives: *{words(ids('D'))}*, {len(ids('D'))} tokens, nothing in common with the others, so it needs "
        f"{d_need} fresh blocks. Write D's block table.", "list", d_table, tags={"allocator"},
        slips=[Slip("lowest-id", sorted(real_queue)[:d_need], "Those are the lowest free ids. The free queue is "
                    "not sorted by id: blocks join it in the order they are freed."),
               Slip("most-recent-first", list(reversed(real_queue))[:d_need], "Those are the most recently freed "
                    "blocks. The queue hands out from its front: the blocks freed longest ago, after the ones "
                    "with no hash."),
               Slip("head-first", head_first[:d_need], "That frees each table from its first block on. vLLM frees "
                    "a request's blocks tail first, so the blocks of a shared prefix's head are evicted last."),
               Slip("cached-like-the-rest", paper[:d_need], "That puts every freed block at the back. V1 puts a "
                    "freed block without a hash (B's partly filled last block) at the *front*: it can never be "
                    "hit, so it is reused first.")]
        + ([Slip("partial-block-forgotten", no_exception[:d_need], f"That leaves out block"
                 f"{'s' if len(unhashed) > 1 else ''} {_and(map(str, unhashed))}, the partly filled last block "
                 "of a finished request. It is freed too, and having no hash it can never be hit: V1 puts it at "
                 "the *front* of the free queue, ahead of every cached block, so D takes it first.")]
           if unhashed and no_exception[:d_need] != d_table else []),
        explanation=(f"The free queue after both finished, front first: {real_queue}. D took the first "
                     f"{d_need}: {d_table}" + (f", evicting blocks {evicted} from the prefix cache (their hashes "
                                               "are dropped)." if evicted else ".")))

    # 5. transfer: E sends A's prompt again after D's evictions
    e_stage = st["E"]
    e_tokens = ids("E")
    a_table = st["A"].tables["A"]
    e_chain = chain(e_tokens)
    originals = 0
    for i in range((len(e_tokens) - 1) // B):
        if d_stage.hashes[a_table[i]] != e_chain[i]:
            break
        originals += 1
    evict_hit = Exercise(
        "evict_hit", f"Last, E sends A's prompt again ({len(e_tokens)} tokens), after D took its blocks. How many "
        "of E's tokens does the prefix cache find?", "number", e_stage.cached, unit="tokens", tags={"transfer"},
        slips=[Slip("no-twin", originals * B, f"Block {a_table[originals] if originals < len(a_table) else '?'}, "
                    "A's own copy, was evicted by D, right. But the cache still holds a block with that same hash: "
                    f"C's duplicate, block {c_last}."),
               Slip("whole-prompt", len(e_tokens), "Only full blocks are cached, and never the one holding the last "
                    "prompt token."),
               Slip("all-evicted", 0, "D evicted only what sat at the front of the free queue; the prefix's first "
                    "blocks were freed last, so they are still cached.")],
        explanation=(f"The engine found {e_stage.cached} tokens: E's chain of hashes finds blocks "
                     f"{e_stage.tables['E'][:e_stage.cached // B]}. D evicted {evicted}, but the chain's third hash "
                     f"is still carried by block {c_last}, the duplicate C computed."))

    # 6. honest hit rates, on the real model in a tight pool
    tight = ctx.run(tight_run)
    s = run_stats(tight)
    back = who_came_back(tight)
    H, Q, H2, Q2 = s["hit_tokens"], s["query_tokens"], s["readmission_hit_tokens"], s["readmission_query_tokens"]
    honest_options = {
        "honest": f"{_pct(s['hit_rate_pct'])}: the first admissions' hits over the tokens they queried",
        "mixed": f"{_pct(s['mixed_rate_pct'])}: every admission's hits over every admission's queried tokens",
        "readmit": f"{_pct(s['readmission_rate_pct'])}: the re-admissions' hits over the tokens they queried",
    }
    honest = Exercise(
        "honest", f"In this run the first admissions queried {Q} prompt tokens and found {H} in the cache; "
        f"then {back}, preempted, came back and queried {Q2} tokens (prompt and generated tokens) and "
        f"found {H2}. vLLM's prefix-cache hit rate is meant to tell an "
        "operator how much prompt sharing between requests saves. Which figure does it report?", "choice",
        honest_options["honest"], options=[honest_options[k] for k in ("mixed", "honest", "readmit")],
        slips=[Slip("mixed", honest_options["mixed"], "That mixes in the re-admissions, which mostly find their "
                    "*own* blocks, freed a few steps before: that is not sharing, and a server that preempts a lot "
                    "would look better the more it thrashes."),
               Slip("readmit", honest_options["readmit"], "That is the re-admissions alone: it says how much of "
                    "their own work the preempted requests got back, nothing about sharing between requests.")],
        explanation=(f"vLLM counts re-admissions after a preemption apart (its `PrefixCacheStats`; vLLM issue "
                     f"#25780), and so does this engine: {_pct(s['hit_rate_pct'])} honest, against "
                     f"{_pct(s['mixed_rate_pct'])} with the re-admissions mixed in."),
        answer_phrases=[honest_options["honest"], f"{_pct(s['hit_rate_pct'])} honest",
                        "counts re-admissions after a preemption apart", "leaves them out of its hit rate",
                        "leaves re-admissions out"])

    # 7. transfer: the same requests in a roomy pool at three block sizes
    sw = sweep(ctx)
    big = SWEEP[-1]
    small = SWEEP[0]
    requests = chat_requests(ctx.loaded[1])
    prompts = [p for p, _ in requests]
    shared = common_prefix(prompts)
    later = len(prompts) - 1
    q = sw[big]["query_tokens"]
    token_share = round(pct(later * shared, q), 2)
    rounded_up = round(pct(later * min(-(-shared // big) * big, ((len(prompts[0]) - 1) // big) * big), q), 2)
    slips = [Slip("token-level", token_share, "That counts every shared token; the cache only finds whole blocks "
                  "whose every token is shared."),
             Slip("same-as-small", sw[small]["rate"], f"That is the rate at blocks of {small}. The block size "
                  "decides how much of the shared prompt sits in whole shared blocks."),
             Slip("rounded-up", rounded_up, "That counts the block where the shared prompt ends as a hit, but that "
                  "block also holds each request's own tokens, so its hash differs per request.")]
    slips = _distinct(slips, sw[big]["rate"])
    bs_rate = Exercise(
        "bs_rate", f"The same {len(prompts)} requests in a roomy pool (no preemption), now with blocks of **{big}** "
        "tokens. What hit rate does the engine report?", "number", sw[big]["rate"], unit="%", tolerance=0.5,
        tags={"transfer"}, slips=slips,
        explanation=(f"At blocks of {big}, each later request found {sw[big]['per_later']} tokens: "
                     + (f"the {shared}-token shared prompt is shorter than one block, so every prompt's first "
                        "block also holds words of its own question, and its hash is its own."
                        if shared < big else
                        f"the {shared}-token shared prompt fills {shared // big} whole blocks of {big}, and the "
                        "block where it ends also holds words of each request's own question.")
                     + " The sweep below has all three sizes."))
    return {"chain_hit": chain_hit, "last_token": last_token, "duplicate": duplicate, "evict_table": evict_table,
            "evict_hit": evict_hit, "honest": honest, "bs_rate": bs_rate}


ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth")


def _and(items) -> str:
    """``["second", "third"]`` -> "second and third"; three or more: "a, b and c"."""
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _distinct(slips: list[Slip], expected: float, tol: float = 0.5) -> list[Slip]:
    """Drop slips whose answer is within ``tol`` of the right one or of an earlier slip (a workload change
    could make two coincide)."""
    kept: list[Slip] = []
    for s in slips:
        if abs(s.answer - expected) > tol and all(abs(s.answer - k.answer) > tol for k in kept):
            kept.append(s)
    return kept


# ------------------------------------------------------------------------------------------- reveals
def _pool(stage: Stage, title: str, highlight=None, key: str = ""):
    import streamlit as st

    from lessons.common import manager_snapshot
    from viz import block_pool_figure

    tokens = {s: list(stage.bm.token_ids.get(s, [])) for s in stage.bm.block_tables}
    left, _ = st.columns([3, 2])
    left.plotly_chart(block_pool_figure(manager_snapshot(stage.bm, tokens), list(PROMPTS), decode=words,
                                        highlight=highlight or [], slot_mode=True, title=title),
                      width="stretch", key=f"l8_pool_{key}", config={"displayModeBar": False})
    left.caption("vLLM V1 semantics (BlockManager with V1's free queue). One row per block, one cell per slot; "
                 "light grey \"cached\": free, but still holding a hash the cache can find; pale: free. Framed: "
                 "what this step changed. Hover a row for its hash and words.")


def _queue_line(stage: Stage) -> str:
    marks = [f"{b}{'*' if stage.hashes[b] else ''}" for b in stage.queue]
    return "free queue, front first (* = still has a hash): " + (", ".join(marks) or "empty")


def _table(rows: list[dict]) -> None:
    import pandas as pd
    import streamlit as st

    st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")


def widget_practice_a(ctx) -> None:
    import streamlit as st

    stage = practice()["A"]
    _table(hash_rows(stage, "A"))
    _pool(stage, "after A's prefill", highlight=stage.tables["A"], key="a")
    st.caption(_queue_line(practice()["A done"]) + " (after A finished)")


def reveal_chain_hit(ctx) -> None:
    import streamlit as st

    _table(hash_rows(practice()["B"], "B", lookup=True))
    st.caption("Compare the hash column with A's table above: not one of B's hashes is among A's.")


def last_token_rows(stage: Stage) -> list[dict]:
    """What the last-token question needs, per block of C's prompt: its words, whether the lookup found it,
    and how many of its tokens the prefill computes. No hash or physical block: where C's recomputed block
    went and what still carries its hash is the next question's (``duplicate``) answer."""
    tokens = ids(stage.request)
    rows = []
    for i in range(-(-len(tokens) // BLOCK_SIZE)):
        n = len(tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
        found = i * BLOCK_SIZE < stage.cached
        rows.append({"logical block": i, "tokens": words(tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]),
                     "found in the cache?": "yes" if found else "no", "tokens computed": 0 if found else n})
    return rows


def reveal_last_token(ctx) -> None:
    _table(last_token_rows(practice()["C"]))


def reveal_duplicate(ctx) -> None:
    stage = practice()["C"]
    _table(hash_rows(stage, "C", lookup=True))
    _pool(stage, "after C's prefill", highlight=[stage.tables["C"][-1]], key="c")
    rows = [{"hash": h, "blocks carrying it": ", ".join(map(str, bs)),
             "in use or free": ", ".join(f"{b}: {'in use' if stage.counts[b] else 'free'}" for b in bs)}
            for h, bs in hash_holders(stage).items()]
    _table(rows)


def widget_pool_before(ctx) -> None:
    import streamlit as st

    stage = practice()["C"]
    _pool(stage, "B and C running", key="before")
    st.markdown(f"`{_queue_line(stage)}`")


def reveal_evict_table(ctx) -> None:
    import streamlit as st

    stages = practice()
    done = stages[f"{FINISH_ORDER[-1]} done"]
    st.markdown(f"After {FINISH_ORDER[0]} and {FINISH_ORDER[1]} finished: `{_queue_line(done)}`")
    d = stages["D"]
    _pool(d, "after D's prefill", highlight=d.tables["D"], key="d")
    st.markdown("\n".join(f"- {e.message}" for e in d.events if e.kind in ("evict", "allocate")))


def reveal_evict_hit(ctx) -> None:
    stage = practice()["E"]
    _table(hash_rows(stage, "E", lookup=True))
    _pool(stage, "after E's prefill", highlight=stage.tables["E"], key="e")


def reveal_honest(ctx) -> None:
    import streamlit as st

    s = run_stats(ctx.run(tight_run))
    _table([{"admissions": "first admissions", "requests": s["requests"], "queried tokens": s["query_tokens"],
             "found in the cache": s["hit_tokens"], "hit rate": _pct(s["hit_rate_pct"])},
            {"admissions": "re-admissions after a preemption", "requests": s["readmissions"],
             "queried tokens": s["readmission_query_tokens"], "found in the cache": s["readmission_hit_tokens"],
             "hit rate": _pct(s["readmission_rate_pct"])},
            {"admissions": "both mixed (inflated)", "requests": s["requests"] + s["readmissions"],
             "queried tokens": s["query_tokens"] + s["readmission_query_tokens"],
             "found in the cache": s["hit_tokens"] + s["readmission_hit_tokens"], "hit rate": _pct(s["mixed_rate_pct"])}])
    st.caption("vLLM V1 semantics, from the engine's prefix-cache counters (engine.metrics.prefix_cache_stats).")


def reveal_bs_rate(ctx) -> None:
    import streamlit as st

    sw = sweep(ctx)
    _table([{"block size": B, "tokens each later request found": v["per_later"],
             "hit rate (first admissions)": _pct(v["rate"]), "blocks in use after the prefill": v["blocks_after_prefill"]}
            for B, v in sw.items()])
    st.caption(f"vLLM V1 semantics; each run in a roomy pool of {ROOMY_SLOTS} slots, so nobody is preempted.")


def widget_runs(ctx) -> None:
    import streamlit as st

    from lessons.widgets import step_through

    tokenizer = ctx.loaded[1]
    with st.container(border=True):
        st.caption("The tight-pool run (vLLM V1 semantics): jump between the admissions, the prefix-cache hits "
                   "and the preemptions; a re-admission's hits say \"on re-admission\".")
        step_through(ctx.run(tight_run), "l8_step_tight", lambda t: tokenizer.decode(t),
                     jump_kinds=("admit", "prefix_hit", "preempt"))


if __name__ == "__main__":
    from lessons.render import render_lesson

    render_lesson(__file__)

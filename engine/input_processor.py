"""Requests in: validate and tokenize a prompt and its ``SamplingParams`` before anything is added (vLLM
V1's ``vllm/v1/engine/processor.py``: the engine's input processor).

Every refusal is a ValueError naming the bad value, raised before the engine changes: a prompt that can
never run (more blocks than the pool, or no room for one generated token within max_model_len, vLLM's
rule), judged by its length before any per-token work (a token list before its ids are read, a text before
it is tokenized); a token id outside the vocabulary; more samples or beams than ``max_num_seqs`` or than the
allocator serves per request, or than the pool can hold when none shares; a bad ``final_len``.
"""

from __future__ import annotations

import copy
import json
import numbers
import random

from . import beam_search
from .config import MAX_SEED, EngineConfig, SamplingParams
from .sequence import BeamState, Request, Sequence, generator_for


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



class InputProcessor:
    """Turns prompts into validated ``Request``s for one engine: its ``config``, ``tokenizer``, the model's
    ``vocab_size``, its ``allocator`` (``reservation_for``, ``max_seqs_per_request``), ``max_model_len``,
    ``block_size`` and ``num_blocks`` (the pool's)."""

    def __init__(self, config: EngineConfig, tokenizer, vocab_size: int, allocator, max_model_len: int,
                 block_size: int, num_blocks: int) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.allocator = allocator
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_blocks = num_blocks

    def make_request(self, prompt, params: SamplingParams, rid: str, final_len: int | None = None,
                     priority: int = 0) -> Request:
        """Validate and tokenize a request with id ``rid`` (checked free by the caller); raises ValueError
        naming the bad value, and builds nothing, on bad input."""
        text, ids = self._tokenize(prompt)
        if params.num_seqs > self.config.max_num_seqs:
            raise ValueError(f"{params.num_seqs} samples/beams exceed max_num_seqs {self.config.max_num_seqs}; "
                             f"they could never run together")
        per_request = self.allocator.max_seqs_per_request
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
        reservation = self.allocator.reservation_for(len(ids), max_len, final_len)
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
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop token id {bad[0]} is not in the vocabulary [0, {self.vocab_size})")
        seed = params.seed if params.seed is not None else random.randrange(2**62)
        req = Request(rid, text, ids, params, seed, max_len=min(max_len, reservation or max_len),
                      reservation=rows, priority=priority)
        first_id = rid if params.num_seqs == 1 else (f"{rid}.b0" if params.beam_width > 1 else f"{rid}.0")
        req.seqs.append(Sequence(first_id, list(ids), len(ids), generator_for(seed, 0)))
        if params.beam_width > 1:
            req.beam = BeamState(finished=[(beam_search.BEAM_NEG, None, None)] * params.beam_width)
        return req

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
        longest = self.longest_token_chars()
        if longest is None:
            return
        normalizer = self.tokenizer.backend_tokenizer.normalizer
        chars = len(normalizer.normalize_str(text)) if normalizer is not None else len(text)
        least = -(-chars // longest)
        self._check_prompt_len(least, f"prompt of {len(text):,} characters (at least {least:,} tokens: no token "
                                      f"of this tokenizer is longer than {longest} characters)")

    def longest_token_chars(self) -> int | None:
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
            vocab = self.vocab_size
            bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
            if bad:
                raise ValueError(f"prompt token id {bad[0]!r} is not an integer")
            ids = [int(t) for t in prompt]  # numpy / torch integers too
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} is not in the vocabulary [0, {vocab})")
            return None, ids
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    @staticmethod
    def child_requests(parent: Request, params: SamplingParams, rid: str, taken) -> list[Request]:
        """V1's ``n > 1``: the ``n`` child requests "<rid>.0" .. of ``parent`` (the request validated once with
        n=1), differing only in id and seed (vLLM's ``ParentRequest``: seed + i). ``taken(id)``: whether an id
        is in use. Raises ValueError for a taken id or a last seed not below 2**62."""
        if parent.seed + params.n - 1 >= MAX_SEED:
            raise ValueError(f"seed {parent.seed} + {params.n - 1} (the last of n={params.n} samples' seeds) is not "
                             f"below 2**62")
        children = []
        for i in range(params.n):
            cid = f"{rid}.{i}"
            if taken(cid):
                raise ValueError(f"request_id {cid!r} is already in use")
            seed = parent.seed + i
            child_params = copy.copy(params)  # the parent's, validated; only n and the seed differ
            child_params.n, child_params.seed = 1, seed
            child = copy.copy(parent)
            child.request_id, child.params, child.seed, child.parent_id = cid, child_params, seed, rid
            child.seqs = [Sequence(cid, list(parent.prompt_token_ids), len(parent.prompt_token_ids),
                                   generator_for(seed, 0))]
            children.append(child)
        return children

"""Run a transformers Llama-family model over packed tokens with K/V kept in the paged cache.

Approach: our own forward loop over the Hugging Face modules. We call the model's own embedding, rotary
embedding, RMSNorms, q/k/v/o projections, RoPE function and MLPs with its own weights, and replace only the
two lines that store and read K/V: new keys/values are scattered into the block pool at the slot mapping
(``kernels.write_kv``), and attention reads the context through the block table
(``kernels.paged_attention``).

Why not a custom ``Cache`` or attention function plugged into ``model.forward``: transformers' forward
builds a padded ``[batch, seq]`` causal mask and expects one cache per batch row; a serving engine runs a
*packed* batch (prefill chunks and decode tokens of different sequences one after another, vLLM's
"varlen" layout) with one shared pool. Driving the layers ourselves keeps that layout explicit and the
code short, and it stays the model's math: our tests check greedy tokens and logits against
``model.generate``.

KV cache groups (a hybrid model: some layers attend over a sliding window, some to everything; vLLM V1's
hybrid KV cache manager): each group has its own block table and slot mapping per sequence
(``SchedulerOutput``'s ``block_tables[g]`` / ``slot_mappings[g]``), and layer ``l`` reads and writes
through the ones of its group (``KVCache.layer_group[l]``) with its own window
(``KVCache.layer_window[l]``), as vLLM's model runner hands each attention layer its group's
``AttentionMetadata``. A sliding group's table holds -1 (the null block) where blocks left the window:
attention never reads there, as every position it reads is inside the window.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import kernels


@dataclass
class SeqInput:
    """One sequence's share of a step.

    ``token_ids`` are the tokens computed now, at positions ``start_pos ..``; ``slot_mappings[g]`` says
    where their K/V go in KV cache group ``g``; ``block_tables[g]`` lists the sequence's physical blocks
    there; after this step the cache holds ``start_pos + len(token_ids)`` of its tokens.
    """

    seq_id: str
    token_ids: list[int]
    start_pos: int
    slot_mappings: tuple[list[int], ...]
    block_tables: tuple[list[int], ...]
    region_start: int = 0  # contiguous baseline: the first slot of the sequence's reserved range


class ModelRunner:
    """Owns the model and the KV cache tensors; ``execute`` runs one packed batch and returns logits."""

    def __init__(self, model, kv_cache, backend: str, contiguous: bool = False) -> None:
        self.model = model
        self.contiguous = contiguous
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = next(model.parameters()).device
        base = model.model
        self.base = base
        first_attn = base.layers[0].self_attn
        # The model's own RoPE function (Qwen, Mistral, Llama each define theirs in their module).
        self.apply_rope = sys.modules[type(first_attn).__module__].apply_rotary_pos_emb
        self.head_dim = first_attn.head_dim
        self.layers = [_fused_layer(layer) for layer in base.layers]
        self.layer_group = kv_cache.layer_group
        self.layer_window = kv_cache.layer_window

    def execute_model(self, output) -> dict[str, torch.Tensor]:
        """Run one step as the scheduler wrote it down (a ``scheduler_output.SchedulerOutput``, the only thing
        read from the scheduler): apply its ``kv_ops`` (swaps, copy-on-write copies) to the KV tensors, then
        compute its scheduled tokens. Returns the logits ``[vocab]`` of each sequence that samples, by id."""
        self.kv_cache.apply(output.kv_ops)
        if not output.scheduled:
            return {}
        logits = self.execute([SeqInput(s.seq_id, s.token_ids, s.num_computed_tokens, s.slot_mappings,
                                        s.block_tables, s.region_start) for s in output.scheduled])
        return {s.seq_id: logits[i] for i, s in enumerate(output.scheduled) if s.sample}

    @torch.inference_mode()
    def execute(self, seqs: list[SeqInput]) -> torch.Tensor:
        """Compute the given tokens of every sequence and return float32 logits ``[num_seqs, vocab]`` of
        each sequence's last token."""
        dev = self.device
        input_ids = torch.tensor([t for s in seqs for t in s.token_ids], device=dev)
        positions = torch.tensor(
            [s.start_pos + i for s in seqs for i in range(len(s.token_ids))], device=dev
        )
        num_groups = len(seqs[0].slot_mappings)
        slot_mappings = [torch.tensor([x for s in seqs for x in s.slot_mappings[g]], device=dev)
                         for g in range(num_groups)]
        q_lens = torch.tensor([len(s.token_ids) for s in seqs])
        query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.long)
        query_start_loc[1:] = torch.cumsum(q_lens, 0)
        context_lens = torch.tensor([s.start_pos + len(s.token_ids) for s in seqs])
        metas = []
        for g in range(num_groups):
            if self.contiguous:
                where = torch.tensor([s.region_start for s in seqs])  # each sequence's range, no block table
            else:
                max_blocks = max(len(s.block_tables[g]) for s in seqs)
                where = torch.full((len(seqs), max_blocks), -1, dtype=torch.int32)
                for i, s in enumerate(seqs):
                    where[i, : len(s.block_tables[g])] = torch.tensor(s.block_tables[g], dtype=torch.int32)
            metas.append((where.to(dev), context_lens.to(dev), query_start_loc.to(dev)))
        maxima = {"max_query_len": int(q_lens.max()), "max_context_len": int(context_lens.max())}

        hidden = self._forward(input_ids, positions, slot_mappings, metas, maxima)
        last = (query_start_loc[1:] - 1).to(dev)
        return self.model.lm_head(hidden[last]).float()

    def _forward(self, input_ids, positions, slot_mappings, metas, maxima) -> torch.Tensor:
        """Decoder stack on ``T`` packed tokens -> final hidden states ``[T, hidden]``; layer ``l`` reads
        and writes through its KV cache group's slot mapping and block tables, with its own window."""
        base = self.base
        num_tokens = input_ids.shape[0]
        h = base.embed_tokens(input_ids)[None]  # [1, T, hidden]: the modules expect a batch dim
        cos, sin = base.rotary_emb(h, positions[None])
        for layer_idx, fl in enumerate(self.layers):
            residual = h
            x = fl.input_layernorm(h)
            q, k, v = F.linear(x, fl.qkv_weight, fl.qkv_bias).split(fl.qkv_sizes, dim=-1)
            q = q.view(1, num_tokens, -1, self.head_dim)
            k = k.view(1, num_tokens, -1, self.head_dim)
            v = v.view(1, num_tokens, -1, self.head_dim)
            if fl.q_norm is not None:  # Qwen3: RMSNorm over head_dim before RoPE
                q, k = fl.q_norm(q), fl.k_norm(k)
            q, k = self.apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [1, heads, T, D]
            q, k, v = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0]  # [T, heads, D]
            kc, vc = self.kv_cache.key_cache[layer_idx], self.kv_cache.value_cache[layer_idx]
            group = self.layer_group[layer_idx]
            kernels.write_kv(k, v, kc, vc, slot_mappings[group], backend=self.backend)
            if self.contiguous:
                o = kernels.contiguous_attention(q, kc.view(-1, *kc.shape[2:]), vc.view(-1, *vc.shape[2:]),
                                                 *metas[group], scale=fl.scaling)
            else:
                o = kernels.paged_attention(q.contiguous(), kc, vc, *metas[group], scale=fl.scaling,
                                            backend=self.backend, sliding_window=self.layer_window[layer_idx],
                                            **maxima)
            h = residual + fl.o_proj(o.reshape(1, num_tokens, -1))
            gate, up = F.linear(fl.post_attention_layernorm(h), fl.gate_up_weight, fl.gate_up_bias).chunk(2, dim=-1)
            h = h + fl.down_proj(fl.act_fn(gate) * up)
        return base.norm(h)[0]


@dataclass
class _FusedLayer:
    """One decoder layer's modules and its projections as one matrix each: q, k and v in one ``[q+k+v,
    hidden]`` weight and the MLP's gate and up in one ``[2 x intermediate, hidden]`` weight (vLLM's
    ``QKVParallelLinear`` and ``MergedColumnParallelLinear``): 2 matrix products where there were 5."""

    input_layernorm: torch.nn.Module
    post_attention_layernorm: torch.nn.Module
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    qkv_sizes: list[int]
    q_norm: torch.nn.Module | None
    k_norm: torch.nn.Module | None
    o_proj: torch.nn.Module
    scaling: float
    gate_up_weight: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_proj: torch.nn.Module
    act_fn: torch.nn.Module


_FUSE_LOCK = threading.Lock()


def _fused_layer(layer) -> _FusedLayer:
    attn, mlp = layer.self_attn, layer.mlp
    with _FUSE_LOCK:  # the app shares one model between sessions; the first runner fuses it, once
        qkv_w, qkv_b = _fuse(attn.q_proj, attn.k_proj, attn.v_proj)
        gate_up_w, gate_up_b = _fuse(mlp.gate_proj, mlp.up_proj)
    return _FusedLayer(layer.input_layernorm, layer.post_attention_layernorm, qkv_w, qkv_b,
                       [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features],
                       getattr(attn, "q_norm", None), getattr(attn, "k_norm", None), attn.o_proj, attn.scaling,
                       gate_up_w, gate_up_b, mlp.down_proj, mlp.act_fn)


def _fuse(*linears: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One ``[sum of out_features, in]`` weight (and bias) for ``linears``, without a second copy: their
    own weights become views into it, so the model (``generate`` included) reads the same memory and
    stays as it was. Idempotent: already fused linears return the tensor they share."""
    weights = [m.weight for m in linears]
    base = weights[0].data
    if all(w.data.data_ptr() == base.data_ptr() + sum(x.numel() for x in weights[:i]) * base.element_size()
           and w.data.is_contiguous() for i, w in enumerate(weights)) and base._base is not None:
        fused_w = base._base
    else:
        fused_w = torch.cat([w.data for w in weights], dim=0)
        _point_into(weights, fused_w)
    biases = [m.bias for m in linears]
    if any(b is None for b in biases):
        if any(b is not None for b in biases):  # mixed: keep the biases apart, add them after the product
            raise ValueError("cannot fuse projections of which only some have a bias")
        return fused_w, None
    b0 = biases[0].data
    if b0._base is not None and b0._base.numel() == sum(b.numel() for b in biases):
        return fused_w, b0._base
    fused_b = torch.cat([b.data for b in biases], dim=0)
    _point_into(biases, fused_b)
    return fused_w, fused_b


def _point_into(params: list[torch.nn.Parameter], fused: torch.Tensor) -> None:
    start = 0
    for p in params:
        n = p.shape[0]
        p.data = fused[start:start + n]
        start += n

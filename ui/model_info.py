"""The loaded model's architecture and the KV cache bytes per token, computed from its config."""

import streamlit as st

from engine.model_loader import geometry_from_config
from ui.state import default_settings, get_lab, shared_model

lab = get_lab()
model_id = lab.run.settings.model if lab else default_settings().model
try:
    model, tokenizer = shared_model(model_id)
except ValueError as exc:
    st.error(str(exc))
    st.stop()
cfg = model.config
st.title("Model")
st.caption(model_id)
dtype = str(next(model.parameters()).dtype).replace("torch.", "")
g = geometry_from_config(cfg, dtype)
cols = st.columns(4)
cols[0].metric("layers", g.num_layers)
cols[1].metric("query heads / KV heads", f"{g.num_heads} / {g.num_kv_heads}")
cols[2].metric("head_dim", g.head_dim)
cols[3].metric("parameters", f"{sum(p.numel() for p in model.parameters()):,}")
st.subheader("KV cache per token")
st.latex(r"\text{bytes/token} = 2\,(K,V) \times \text{layers} \times \text{KV heads} \times \text{head\_dim}"
         r" \times \text{bytes per element}")
st.latex(rf"= 2 \times {g.num_layers} \times {g.num_kv_heads} \times {g.head_dim} \times {g.dtype_bytes}"
         rf" = {g.bytes_per_token:,}\ \text{{bytes}}".replace(",", "{,}"))
st.write(f"A block of 16 tokens holds {g.bytes_per_block(16):,} bytes; 1,000 tokens take "
         f"{1000 * g.bytes_per_token / 2**20:.2f} MiB. Grouped-query attention stores {g.num_kv_heads} KV heads "
         f"for {g.num_heads} query heads: {g.num_heads // g.num_kv_heads}x less than one per query head. "
         "Source of the formula: Kwon et al., SOSP 2023, section 2.")
st.json({"model_type": cfg.model_type, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
         "max_position_embeddings": cfg.max_position_embeddings, "dtype": dtype})

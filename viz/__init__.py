"""Plotly figure builders: pure functions of step records and snapshots (no Streamlit, no torch). Every
count or ratio a figure shows comes from ``engine.metrics`` (torch-free), never from arithmetic here.

- ``block_pool_figure``: the paged block pool, one heatmap cell per physical block.
- ``contiguous_region_figure``: the contiguous baseline's region on the same scale.
- ``timeline_figure``: KV utilisation and running requests over steps, paged vs contiguous.
- ``step_tokens_figure``: tokens each step computed, decode and prefill (chunks) stacked, with V1's budget;
  ``describe_step`` / ``step_label``: a step by its parts in words (a mixed step's decode tokens and chunks).
- ``block_table_rows``: each sequence's logical -> physical table as plain rows for a table widget.
- ``gpu_memory_figure``: how a GPU's memory divides into weights and KV cache (lesson 1).
- ``prefix_tree_figure``, ``batch_activity_figure``, ``cache_size_figure``: a server's prefix cache rebuilt
  from its KV events (the Server page).
- ``colors``: the colour-blind-safe request palette shared by every view.
"""

from .colors import request_color, request_colors
from .memory import gpu_memory_figure
from .pool import block_pool_figure, block_table_rows, pool_cells, swap_pool_figure
from .server import batch_activity_figure, cache_size_figure, prefix_tree_figure
from .region import contiguous_region_figure, paged_slot_cells, paged_slots_figure, region_cells
from .steps import describe_step, sharing_counts, step_label, step_parts, step_tokens_figure
from .timeline import timeline_figure

__all__ = ["block_pool_figure", "gpu_memory_figure", "block_table_rows", "contiguous_region_figure", "paged_slot_cells",
           "paged_slots_figure", "pool_cells", "region_cells", "swap_pool_figure",
           "request_color", "request_colors", "timeline_figure", "describe_step", "sharing_counts", "step_label",
           "step_parts", "step_tokens_figure", "batch_activity_figure", "cache_size_figure", "prefix_tree_figure"]

"""Whether a KV pool and a swap pool fit the machine, checked before either is allocated."""

from __future__ import annotations

import torch

from . import memory


def check_memory(device: torch.device, num_blocks: int, block_size: int, bytes_per_block: int,
                 swap_blocks: int = 0) -> None:
    """Refuse a KV pool of ``num_blocks`` blocks of ``block_size`` tokens (``bytes_per_block`` bytes each) on
    ``device``, and a CPU swap pool of ``swap_blocks`` blocks, that the machine cannot hold.

    Free memory is ``torch.cuda.mem_get_info`` on CUDA; on the host it is the smaller of the free RAM and
    what the container's cgroup limit allows (``engine.memory.available_host_memory_bytes``). The swap
    pool always lives in host memory, so with the pool on the CPU both must fit together.

    Raises:
        ValueError: the pool or the swap pool (naming ``swap_space_blocks``) does not fit, with the
            sizes in GiB.
    """
    gib = 2**30
    nbytes = num_blocks * bytes_per_block
    host = memory.available_host_memory_bytes()
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else host
    if free is not None and nbytes > free:
        raise ValueError(
            f"a KV pool of {num_blocks} blocks x {block_size} tokens needs {nbytes / gib:.2f} GiB "
            f"but only {free / gib:.2f} GiB are free on {device}; use fewer blocks or a smaller budget")
    swap_bytes = swap_blocks * bytes_per_block
    pool_on_host = 0 if device.type == "cuda" else nbytes
    if host is not None and swap_bytes and pool_on_host + swap_bytes > host:
        also = f" besides the KV pool's {nbytes / gib:.2f} GiB" if pool_on_host else ""
        raise ValueError(
            f"swap_space_blocks {swap_blocks} needs {swap_bytes / gib:.2f} GiB of CPU memory for the swap pool"
            f"{also} but only {host / gib:.2f} GiB are free on the host; use a smaller swap_space_blocks")

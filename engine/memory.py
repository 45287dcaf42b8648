"""How much host (CPU) memory a new allocation can get, as the kernel and the container's cgroup see it.

The host's free RAM alone overstates it inside a container with a memory limit: allocating past the
cgroup limit gets the process killed by the kernel's OOM killer instead of a Python error.
"""

from __future__ import annotations

import os

# cgroup v2 (unified hierarchy) and cgroup v1 (memory controller): limit file, usage file.
CGROUP_V2_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current")
CGROUP_V1_FILES = ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")
# cgroup v1 writes "no limit" as a huge number (about 2**63, rounded down to a page); v2 writes "max".
NO_LIMIT_BYTES = 2**60


def _read_bytes(path: str) -> int | None:
    """The integer in a cgroup file; None when it is absent, unreadable, "max" or not a number."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cgroup_available_bytes() -> int | None:
    """Bytes the current cgroup may still allocate (limit - usage, >= 0); None when there is no limit.

    Reads cgroup v2 (``memory.max`` - ``memory.current``), else cgroup v1 (``memory.limit_in_bytes`` -
    ``memory.usage_in_bytes``). A limit of "max" or of ``NO_LIMIT_BYTES`` or more means no limit.
    """
    for limit_path, usage_path in (CGROUP_V2_FILES, CGROUP_V1_FILES):
        limit = _read_bytes(limit_path)
        if limit is None or limit >= NO_LIMIT_BYTES:
            continue
        usage = _read_bytes(usage_path) or 0
        return max(limit - usage, 0)
    return None


def physical_free_bytes() -> int | None:
    """The kernel's free physical memory in bytes (``SC_AVPHYS_PAGES`` x page size); None where unknown."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def available_host_memory_bytes() -> int | None:
    """Bytes of host memory a new allocation can get: the smaller of the host's free physical memory
    and what the container's cgroup limit still allows; None when neither can be read."""
    known = [n for n in (physical_free_bytes(), cgroup_available_bytes()) if n is not None]
    return min(known) if known else None

"""Load a Llama-family causal LM and its tokenizer with transformers, and read its KV geometry.

Rules: safetensors weights only (``use_safetensors=True``), never ``trust_remote_code``. A model is a
local directory or a hub id; a hub id that is not cached on a machine without network fails with one
line that names the embedded default model. A hub model whose safetensors files total more than
``max_download_bytes()`` (``PAL_MAX_DOWNLOAD_MB``, default 2 GiB) is refused from the hub's file list before
its weights are fetched, on every machine: transformers and huggingface_hub have no byte cap of their own, and
a download too large for the disk fails any process that loads, the CLI's as much as the app's (so the cap is
the loader's, not a deployment's). Which models a class server serves is the app's deployment policy, which
the app checks before it calls this loader; nothing here reads it.
"""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass

import torch

from .config import EMBEDDED_MODEL, resolved_model_path

MIB = 2**20
MAX_DOWNLOAD_ENV = "PAL_MAX_DOWNLOAD_MB"
DEFAULT_MAX_DOWNLOAD_MB = 2048

# Model types whose decoder layers have the Llama shape the model runner drives (pre-norm, q/k/v/o
# projections, RoPE, gated MLP). Qwen3 adds per-head q/k RMSNorms, which the runner applies. Some layers
# of Mistral, Ministral and Qwen2/3 may attend over a sliding window: the engine reads them into KV cache
# groups (``engine.kv_cache.kv_cache_groups``) and runs them with V1 semantics.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "ministral", "qwen2", "qwen3")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_IMPORT_LOCK = threading.Lock()


def transformers_api():
    """The ``transformers`` module, imported under one process-wide lock. Its lazy top-level module is not
    safe to import from two threads at once: while a background thread's first import runs, another
    thread's ``from transformers import AutoConfig`` raises ImportError (3 of 3 tries with transformers
    5.24). The app imports it from page threads and from the background model preload, so every import of
    transformers in the project goes through here."""
    with _IMPORT_LOCK:
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401  resolved once, here
    return transformers


@dataclass(frozen=True)
class KVGeometry:
    """The shape of one token's KV cache, read from a model config.

    bytes_per_token = 2 (K and V) x num_layers x num_kv_heads x head_dim x dtype_bytes
    (Kwon et al., SOSP 2023, section 2.2; e.g. Llama-2-7B in fp16: 2*32*32*128*2 = 524,288 B = 512 KiB).
    """

    num_layers: int
    num_kv_heads: int
    num_heads: int
    head_dim: int
    dtype: str

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=_DTYPES[self.dtype]).element_size()

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def bytes_per_block(self, block_size: int) -> int:
        return self.bytes_per_token * block_size


def resolve_device(device: str) -> torch.device:
    """"auto" -> CUDA if available else CPU. Raises ValueError for an unknown device or absent CUDA."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        return torch.device("cpu")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
        return torch.device("cuda")
    raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")


def resolve_dtype(dtype: str | None, device: torch.device) -> str:
    """None -> float32 on CPU, bfloat16 on CUDA."""
    if dtype is None:
        return "bfloat16" if device.type == "cuda" else "float32"
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {tuple(_DTYPES)}, got {dtype!r}")
    return dtype


def geometry_from_config(config, dtype: str) -> KVGeometry:
    """KV geometry of a transformers config (head_dim falls back to hidden_size // num_attention_heads)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return KVGeometry(config.num_hidden_layers, kv_heads, heads, head_dim, dtype)


class ModelLoadError(ValueError):
    """The model could not be found, read or is not supported; the message is one line."""


def _one_line(exc: BaseException) -> str:
    """``Type: first line of the message`` of an exception, for a one-line error."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _is_local(model: str) -> bool:
    return os.path.isdir(os.path.expanduser(model))


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # an id the hub library rejects is not cached either
        return False


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """Can we open a TCP connection to the hub (HF_ENDPOINT or huggingface.co)? False when offline
    (HF_HUB_OFFLINE=1) or when the network is unreachable, so a missing model fails in seconds."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def load_model(model: str, device: torch.device, dtype: str):
    """Load ``(model, tokenizer)`` from a local directory or a hub id.

    Raises:
        ModelLoadError: the path/id cannot be found (offline with an uncached hub id included), the
            model type is not Llama-family, the weights are not
            safetensors, or anything else fails while loading (a corrupt config.json or weights file, an
            unreadable file): always one line that names ``model`` as given, never a traceback.
    """
    try:
        return _load_model(model, device, dtype)
    except ModelLoadError:
        raise
    except Exception as exc:  # e.g. a truncated safetensors file, a tokenizer file that does not parse
        raise ModelLoadError(f"cannot load model {model!r}: {_one_line(exc)}") from exc


def _load_model(model: str, device: torch.device, dtype: str):
    tf = transformers_api()
    AutoConfig, AutoModelForCausalLM, AutoTokenizer = tf.AutoConfig, tf.AutoModelForCausalLM, tf.AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the weight-loading bar would clutter the CLI and test logs

    source = os.path.expanduser(model) if _is_local(model) else model
    # A hub id is "name" or "org/name"; anything path-like that is not a directory is a missing folder.
    if not _is_local(model) and (model.startswith((".", "/", "~")) or model.count("/") > 1):
        if os.path.exists(os.path.expanduser(model)):
            raise ModelLoadError(f"model path {model!r} is a file, not a model directory")
        raise ModelLoadError(f"model directory {model!r} does not exist")
    offline_msg = (f"cannot load model {model!r}: not a local directory and not in the hub cache, and the hub "
                   f"cannot be reached (offline?). The embedded default model is {EMBEDDED_MODEL}")
    if not _is_local(model) and not _in_hub_cache(model) and not _hub_reachable():
        raise ModelLoadError(offline_msg)  # at once, instead of a long series of retries
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=False)
    except OSError as exc:
        if _is_local(model):  # e.g. a config.json that is not valid JSON, or unreadable
            raise ModelLoadError(f"cannot read the config.json of {model!r}: {_one_line(exc)}") from exc
        raise ModelLoadError(offline_msg) from exc
    except ValueError as exc:  # a directory without a usable config.json
        raise ModelLoadError(f"{model!r} is not a model transformers can read: "
                             f"{str(exc).splitlines()[0]}") from exc
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"model {model!r} has model_type {config.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if not _is_local(model):
        _check_hub_size(model)  # config.json is small; the weights are not: refuse before fetching them
    try:
        hf_model = AutoModelForCausalLM.from_pretrained(
            source, dtype=_DTYPES[dtype], use_safetensors=True, trust_remote_code=False
        )
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=False)
    except OSError as exc:
        raise ModelLoadError(f"cannot load weights of {model!r} (safetensors only): {str(exc).splitlines()[0]}") from exc
    hf_model.to(device).eval()
    return hf_model, tokenizer


def _check_hub_size(repo_id: str) -> None:
    """Refuse a hub model whose safetensors files total more than ``max_download_bytes()``, read
    from the hub's file list (``HfApi.model_info(files_metadata=True)``) before anything large is fetched.
    transformers and huggingface_hub have no byte cap of their own on a download, so this is the cap. When
    the list cannot be read (offline with the model cached, a private repo) nothing is refused here.

    Raises:
        ModelLoadError: the weights are larger than the cap, naming the model, its size and the cap.
    """
    if _in_hub_cache(repo_id) and not _hub_reachable(timeout_s=1.0):
        return  # cached and offline: nothing will be downloaded
    try:
        from huggingface_hub import HfApi

        info = HfApi().model_info(repo_id, files_metadata=True)
        nbytes = sum(s.size or 0 for s in info.siblings or () if s.rfilename.endswith(".safetensors"))
    except Exception:  # noqa: BLE001  no list to read: the download itself says what is wrong
        return
    try:
        check_download_size(repo_id, nbytes)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None


def max_download_bytes() -> int:
    """The largest hub download (all safetensors files of a model) this process fetches, in bytes:
    ``PAL_MAX_DOWNLOAD_MB`` MiB (default 2,048). Raises ValueError naming the variable for a value that is
    not a number >= 1."""
    raw = os.environ.get(MAX_DOWNLOAD_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_DOWNLOAD_MB * MIB
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{MAX_DOWNLOAD_ENV}={raw!r} must be a number") from None
    if not value >= 1:
        raise ValueError(f"{MAX_DOWNLOAD_ENV}={raw!r} must be at least 1")
    return int(value * MIB)


def check_download_size(model: str, nbytes: int) -> None:
    """Refuse a hub model whose weight files total more than ``max_download_bytes()``, before fetching.
    Raises ValueError naming the model, its size and the limit (and the variable that sets it)."""
    cap = max_download_bytes()
    if nbytes > cap:
        raise ValueError(f"model {model!r}: its weights are {nbytes / MIB:,.0f} MiB on the hub, more than this "
                         f"server downloads ({cap / MIB:,.0f} MiB, {MAX_DOWNLOAD_ENV}); download it yourself "
                         f"and give the local folder")


_SHARED_LOCK = threading.Lock()


def load_shared(model: str, device: str = "auto", dtype: str | None = None):
    """``(model, tokenizer)`` loaded once per process and shared read-only by every caller (the app's
    sessions, the lessons): weights are never written by the engine, so one copy serves every engine.

    ``device`` ("auto", "cpu", "cuda") and ``dtype`` (None: float32 on the CPU, bfloat16 on CUDA) are
    resolved before the cache is consulted, so "auto" and the device it names share one copy; so is the
    model: a local folder by its real path (``engine.config.resolved_model_path``), so every spelling of one
    folder (``./x``, ``x/``, ``~/x``, a symlink to it) shares one copy. A failed load is not cached (the
    next call tries again).

    Raises:
        ValueError: a bad device or dtype (``resolve_device`` / ``resolve_dtype``).
        ModelLoadError: as ``load_model``.
    """
    dev = resolve_device(device)
    resolved = resolve_dtype(dtype, dev)
    with _SHARED_LOCK:  # two sessions asking at once load the weights once, not twice
        return _load_cached(resolved_model_path(model), str(dev), resolved)


@functools.cache
def _load_cached(model: str, device: str, dtype: str):
    return load_model(model, torch.device(device), dtype)

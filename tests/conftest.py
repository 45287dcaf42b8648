"""Shared fixtures. Tests run offline on the CPU in float32 with the embedded tiny model."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never try the network, even where one exists
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from engine import EMBEDDED_MODEL, EngineConfig, LLMEngine
from engine.threads import configure_threads

# The cores free right now, as the CLI does: with torch's default (all cores) a test run on a machine busy with
# other work slowed down up to 10x while its thread pool fought for the cores (docs/benchmarks.md, cpu-threads).
configure_threads("cli")

# A fixed English text; tests cut prompts of exact token lengths from its encoding.
TEXT = (
    "FIRST CITIZEN. Before we proceed any further, hear me speak. You are all resolved rather to die than "
    "to famish? We know it, we know it. Let us kill him, and we'll have corn at our own price. Is't a "
    "verdict? No more talking on't; let it be done. Away, away! One word, good citizens. We are accounted "
    "poor citizens, the patricians good. What authority surfeits on would relieve us: if they would yield "
    "us but the superfluity, while it were wholesome, we might guess they relieved us humanely; but they "
    "think we are too dear: the leanness that afflicts us, the object of our misery, is as an inventory to "
    "particularise their abundance; our sufferance is a gain to them. Let us revenge this with our pikes, "
    "ere we become rakes: for the gods know I speak this in hunger for bread, not in thirst for revenge."
)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_path() -> str:
    return EMBEDDED_MODEL


@pytest.fixture(scope="session")
def hf_model(model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def text_ids(model_path) -> list[int]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_path)(TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) >= 200
    return ids


@pytest.fixture
def make_engine(model_path):
    def make(**kwargs) -> LLMEngine:
        kwargs.setdefault("device", "cpu")
        kwargs.setdefault("dtype", "float32")
        return LLMEngine(EngineConfig(model=model_path, **kwargs))

    return make


def capture_logits(engine) -> dict[str, list[torch.Tensor]]:
    """Wrap the engine's model runner so every step's logits are kept per sequence id, in step order."""
    seen: dict[str, list[torch.Tensor]] = {}
    execute = engine.runner.execute

    def wrapped(seqs):
        logits = execute(seqs)
        for seq, row in zip(seqs, logits):
            seen.setdefault(seq.seq_id, []).append(row.clone())
        return logits

    engine.runner.execute = wrapped
    return seen


# --- the app in a real browser (tests marked ``browser``) ----------------------------------------------------
ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_app(extra_env: dict | None = None):
    """`streamlit run app.py` on a free localhost port (offline, plus ``extra_env``): a generator that yields
    its base URL once it answers its health check, and stops it afterwards (a fixture's body)."""
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(extra_env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", "app.py", "--server.port", str(port),
                             "--server.address", "127.0.0.1", "--server.headless", "true"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url + "/_stcore/health", timeout=2)
            break
        except OSError:
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("streamlit did not start within 90 s")
    yield url
    proc.terminate()
    proc.wait(timeout=20)


@pytest.fixture(scope="module")
def app_url():
    """`streamlit run app.py` on a free localhost port for one test module; its base URL."""
    yield from serve_app()

"""Shared fixtures. Tests run offline on the CPU in float32 with the embedded tiny model."""

from __future__ import annotations

import json
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

from engine import EMBEDDED_HYBRID_MODEL, EMBEDDED_MODEL, EngineConfig, LLMEngine
from engine.threads import configure_threads

# The cores free right now, as the CLI does: with torch's default (all cores) a test run on a machine busy with
# other work slowed down up to 10x while its thread pool fought for the cores (docs/benchmarks.md, cpu-threads).
if os.environ.get("PYTEST_XDIST_WORKER"):  # one of scripts/test.sh's workers: one core each, one thread each
    os.environ.setdefault("PAL_NUM_THREADS", "1")
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


# --- test tiers: every test is marked by what it needs, found from its code, not by hand ------------------------
# A test needs what its function, the fixtures it uses and the module-level helpers they call name (followed
# through the functions of the test files and conftest that they call, a few levels deep). ``bash scripts/test.sh -m "not slow"`` is the fast
# tier: unit, property and engine tests, no Streamlit script runs, no server, no browser, no vLLM, no
# subprocess. The names that give a need away (a module name, or a global a test's code reads):
NEEDS = {
    # the app: a Streamlit page through streamlit.testing, or the app's session object (ui.lab.Lab) stepping presets
    "app": ("AppTest", "Lab"),
    # a server + headless Chromium, or kaleido (which drives a headless Chromium) for image exports
    "browser": ("app_url", "serve_app", "sync_playwright", "kaleido_ok", "run_gif", "run_mp4", "figure_png"),
    "subprocess": ("subprocess",),  # starts another Python (the CLI, a server, a fresh interpreter)
    # a whole benchmark-sized workload (hundreds of steps), named by its preset or its runner
    "workload": ("lesson-lengths", "chat-workload", "chat-arrivals", "shared_prefix_requests",
                 "pressure_run", "chat_paged"),
}
# Needs that make a test slow; ``peer`` (vLLM itself) and ``gpu`` are marked on their modules already.
SLOW_NEEDS = ("app", "browser", "subprocess", "workload", "peer")


def _names_used(obj, module, depth: int = 4, seen: set | None = None) -> set[str]:
    """Global names read by ``obj``'s code (nested functions and lambdas included), followed into functions
    of ``module`` that it calls, ``depth`` levels deep."""
    seen = set() if seen is None else seen
    code = getattr(getattr(obj, "__wrapped__", obj), "__code__", None)
    if code is None or code in seen:
        return set()
    seen.add(code)
    names: set[str] = set()
    stack = [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        consts = list(c.co_consts)
        consts += [x for k in c.co_consts if isinstance(k, (tuple, frozenset)) for x in k]  # a folded list literal
        names.update(k for k in consts if isinstance(k, str) and len(k) < 40)  # e.g. a preset's name
        stack.extend(k for k in consts if hasattr(k, "co_names"))
    if depth > 0:
        for name in list(names):
            helper = getattr(module, name, None)
            home = sys.modules.get(getattr(helper, "__module__", None) or "")
            if callable(helper) and home is not None and _is_test_module(home):
                names |= _names_used(helper, home, depth - 1, seen)
    return names


def _is_test_module(module) -> bool:
    """A module of this folder (a test file or conftest): its helpers are followed, the project's are not."""
    return Path(getattr(module, "__file__", None) or "/").resolve().parent == Path(__file__).resolve().parent


def _needs(item) -> set[str]:
    module = item.module
    names = set(item.fixturenames) | {module.__name__.rsplit(".", 1)[-1]}
    callspec = getattr(item, "callspec", None)
    if callspec is not None:  # a parametrized test's values, e.g. the preset it runs
        names |= {v for v in callspec.params.values() if isinstance(v, str)} | set(callspec.id.split("-"))
        names.add(callspec.id)
    names |= _names_used(item.function, module)
    for defs in getattr(item, "_fixtureinfo", None).name2fixturedefs.values():
        for fixturedef in defs:
            func = fixturedef.func
            names |= _names_used(func, sys.modules.get(func.__module__, module))
    found = {need for need, words in NEEDS.items() if names & set(words)}
    if any(n.startswith("test_browser") for n in names):
        found.add("browser")
    return found


def pytest_configure(config):
    for need in NEEDS:
        config.addinivalue_line("markers", f"{need}: set by conftest from the test's code (tests/conftest.py NEEDS)")


# Files start longest first: pytest-xdist (``--dist loadfile --no-loadscope-reorder``, scripts/test.sh) hands out
# files in collection order, and a long file handed out last keeps one worker busy after the other has run out of
# work (longest processing time first). A file's seconds are measured (tests/file_durations.json, written by
# scripts/test_durations.py from a whole run's JUnit XML); a file not measured yet is estimated from what its
# tests need (seconds on these 2 cores, order of magnitude).
COST = {"peer": 40.0, "browser": 20.0, "subprocess": 5.0, "workload": 5.0, "app": 2.0}
FILE_DURATIONS = Path(__file__).with_name("file_durations.json")


def _measured_seconds() -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(FILE_DURATIONS.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}  # no table (or a broken one): every file is estimated


def pytest_collection_modifyitems(config, items):
    cost: dict[str, float] = {}
    for item in items:
        needs = _needs(item) | ({"peer"} if "peer" in item.keywords else set())
        for need in needs - {"peer"}:
            item.add_marker(getattr(pytest.mark, need))
        if needs & set(SLOW_NEEDS) and "slow" not in item.keywords:
            item.add_marker(pytest.mark.slow)
        cost[item.nodeid.split("::")[0]] = cost.get(item.nodeid.split("::")[0], 0.0) + max(
            [COST[n] for n in needs if n in COST], default=0.2)
    cost.update({f: s for f, s in _measured_seconds().items() if f in cost})
    rank = {f: i for i, f in enumerate(sorted(cost, key=lambda f: -cost[f]))}  # stable: ties keep their order
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])  # a file's tests keep their order
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
def hybrid_loaded():
    """The embedded hybrid model (``EMBEDDED_HYBRID_MODEL``) as ``(model, tokenizer)``, loaded once per process
    for every test file that runs it."""
    from engine.model_loader import load_model

    return load_model(EMBEDDED_HYBRID_MODEL, torch.device("cpu"), "float32")


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

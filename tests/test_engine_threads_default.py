"""``LLMEngine`` as a library chooses torch's threads as vLLM's CPU backend does unless its caller chose
(``engine.threads.engine_threads``). The machine is faked (topology, free cores): no timing here."""

from __future__ import annotations

import pytest
import torch

from engine import threads
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine


def fake_cpus(cores: int, nodes: int = 1, smt: int = 1) -> list:
    """(cpu id, NUMA node, physical core) of ``cores`` physical cores with ``smt`` logical CPUs each, split
    evenly over ``nodes`` NUMA nodes."""
    per_node = cores // nodes
    return [(c * smt + t, c // per_node, (0, c)) for c in range(cores) for t in range(smt)]


@pytest.fixture
def machine(monkeypatch):
    """A fake machine of 8 physical cores (``machine.busy`` cores busy with other work), nobody having chosen
    threads yet (torch at its default, 8), no thread variables in the environment; torch restored after."""
    class Machine:
        busy = 0.0
        measured = 0
    m = Machine()

    def busy(window_s: float = 0.25) -> float:
        m.measured += 1
        return m.busy
    before = torch.get_num_threads()
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PAL_NUM_THREADS", threads.VLLM_BIND, threads.VLLM_RESERVED):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(threads, "cpu_topology", lambda: fake_cpus(8))
    monkeypatch.setattr(threads, "available_cores", lambda: 8)
    monkeypatch.setattr(threads, "busy_cores", busy)
    monkeypatch.setattr(threads, "_chosen", {"threads": None, "why": None, "by_caller": False})
    torch.set_num_threads(8)  # torch's default on this fake machine: nobody chose
    yield m
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def loaded(model_path):
    from engine.model_loader import load_model

    return load_model(model_path, torch.device("cpu"), "float32")


def build(loaded, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(device="cpu", dtype="float32", num_blocks=8, max_model_len=64, **kwargs), loaded)


def test_without_a_choice_the_engine_takes_vllms_threads(machine, loaded):
    engine = build(loaded)
    assert torch.get_num_threads() == engine.num_threads == 7  # 8 cores less the one vLLM keeps for its engine core
    assert "vLLM's CPU backend" in engine.threads_why
    again = build(loaded)  # the second engine keeps the count without measuring again
    assert again.num_threads == 7 and machine.measured == 1


def test_a_busy_machine_gets_only_its_free_cores(machine, loaded):
    machine.busy = 5.2
    assert build(loaded).num_threads == torch.get_num_threads() == 3
    machine.busy = 9.0
    threads._chosen.update(threads=None)  # a fresh process on a machine busier than its cores
    torch.set_num_threads(8)
    assert build(loaded).num_threads == torch.get_num_threads() == 1


def test_a_callers_set_num_threads_stands(machine, loaded):
    torch.set_num_threads(5)  # before any engine
    engine = build(loaded)
    assert torch.get_num_threads() == engine.num_threads == 5 and "torch.set_num_threads(5)" in engine.threads_why
    assert machine.measured == 0
    threads._chosen.update(threads=None)
    torch.set_num_threads(8)
    build(loaded)  # the engine chooses 7 ...
    torch.set_num_threads(2)  # ... and the caller changes it afterwards
    assert build(loaded).num_threads == torch.get_num_threads() == 2


def test_the_environment_and_the_config_are_a_callers_choice(machine, loaded, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "8")  # torch read it at start: 8
    assert build(loaded).num_threads == torch.get_num_threads() == 8
    monkeypatch.delenv("OMP_NUM_THREADS")
    engine = build(loaded, num_threads=4)
    assert torch.get_num_threads() == engine.num_threads == 4 and engine.threads_why == "EngineConfig.num_threads"
    assert build(loaded).num_threads == 4  # a later engine keeps the caller's count
    threads.configure_threads("app")  # the app's choice (1) stands on an idle 8-core machine
    assert build(loaded).num_threads == torch.get_num_threads() == 1
    assert machine.measured == 0
    with pytest.raises(ValueError, match="num_threads must be a positive integer, got 0"):
        EngineConfig(num_threads=0)


@pytest.mark.parametrize("cpus, env, want", [
    (fake_cpus(2), {}, 1),  # this machine's size: 1, as the peer harness runs vLLM
    (fake_cpus(1), {}, 1),  # nothing to keep back
    (fake_cpus(4, smt=2), {}, 3),  # one thread per physical core
    (fake_cpus(16, nodes=2), {}, 7),  # the first NUMA node only
    (fake_cpus(8), {threads.VLLM_RESERVED: "0"}, 8),
    (fake_cpus(8), {threads.VLLM_BIND: "0-3,6"}, 5),
])
def test_vllms_rule(cpus, env, want, monkeypatch):
    for var in (threads.VLLM_BIND, threads.VLLM_RESERVED):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert threads.vllm_cpu_threads(cpus)[0] == want


def test_a_bad_bind_list_is_named(monkeypatch):
    monkeypatch.setenv(threads.VLLM_BIND, "0-x")
    with pytest.raises(ValueError, match="VLLM_CPU_OMP_THREADS_BIND must be .* got '0-x'"):
        threads.vllm_cpu_threads(fake_cpus(4))

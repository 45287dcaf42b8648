"""``peer.compare``'s checks can fail: each is fed two results in ``peer/vllm_driver.py``'s shape that are
the same but for the one thing it checks, and must name the difference. Plain data, no vLLM, no model.

The vLLM side names the children of an ``n > 1`` request as vLLM does ("0_kids", ``ParentRequest``), the
lab side as the lab does ("kids.0"); the comparisons see both as "kids#0".
"""

from __future__ import annotations

import copy

import pytest

from peer.compare import compare


def _result(kid) -> dict:
    """A three-step run: "solo" and two children of "kids"; kids' child 1 is preempted in step 2 and
    "solo" then both children finish. ``kid(i)``: the side's name of child i."""
    k0, k1 = kid(0), kid(1)
    steps = [
        {"scheduled": {"solo": 9, k0: 9, k1: 9}, "preempted": [], "finished": [], "finish_reasons": {},
         "kv_events": [], "kv_cache_usage": 0.5},
        {"scheduled": {"solo": 1, k0: 1}, "preempted": [k1], "finished": ["solo"],
         "finish_reasons": {"solo": "stop"}, "kv_events": [], "kv_cache_usage": 0.25},
        {"scheduled": {k0: 1, k1: 10}, "preempted": [], "finished": [k0, k1],
         "finish_reasons": {k0: "length", k1: "length"}, "kv_events": [], "kv_cache_usage": 0.0},
    ]
    return {
        "settings": {"watermark": 0.25, "watermark_blocks": 2},
        "requests": {
            "solo": {"outputs": [[5, 14]], "finish_reasons": ["stop"], "stop_reasons": [14],
                     "num_cached_tokens": 0},
            "kids": {"outputs": [[7, 8], [7, 8]], "finish_reasons": ["length", "length"],
                     "stop_reasons": [None, None], "num_cached_tokens": 8,
                     "child_num_cached_tokens": {k0: 0, k1: 8}},
        },
        "steps": steps,
        "num_preemptions": 1,
        "prefix_cache_stats": {"queries": 27, "hits": 8, "preempted_queries": 10, "preempted_hits": 0},
        "child_ids": {"kids": [k0, k1]},
    }


def _vllm() -> dict:
    return _result(lambda i: f"{i}_kids")


def _lab() -> dict:
    return _result(lambda i: f"kids.{i}")


def _failed(vllm: dict, lab: dict) -> dict[str, str]:
    return {c.name: c.detail for c in compare(vllm, lab) if not c.ok}


PREEMPTED = "same requests preempted, in the same order, step by step"
FINISHED = "same requests finished, step by step, with the same finish_reason"
REASONS = "same finish_reason and stop_reason per completion"
WATERMARK = "same watermark applied (share, blocks kept free)"


def test_equal_runs_pass_every_check():
    assert _failed(_vllm(), _lab()) == {}


def test_another_request_preempted_in_the_same_step_fails():
    """Same count per step, another victim: the count alone could not see it."""
    lab = _lab()
    lab["steps"][1]["preempted"] = ["kids.0"]
    failed = _failed(_vllm(), lab)
    assert set(failed) == {PREEMPTED}
    assert "step 2: vLLM ['kids#1'] vs lab ['kids#0']" in failed[PREEMPTED]


def test_preemptions_in_another_order_fail():
    vllm, lab = _vllm(), _lab()
    vllm["steps"][1]["preempted"] = ["1_kids", "0_kids"]
    lab["steps"][1]["preempted"] = ["kids.0", "kids.1"]
    vllm["num_preemptions"] = lab["num_preemptions"] = 2
    assert "vLLM ['kids#1', 'kids#0'] vs lab ['kids#0', 'kids#1']" in _failed(vllm, lab)[PREEMPTED]


def test_a_finish_in_another_step_or_for_another_reason_fails():
    lab = _lab()
    lab["steps"][1]["finish_reasons"]["solo"] = "length"
    assert "step 2: vLLM [('solo', 'stop')] vs lab [('solo', 'length')]" in _failed(_vllm(), lab)[FINISHED]
    lab = _lab()
    lab["steps"][1]["finished"] = []
    lab["steps"][2]["finished"].append("solo")
    lab["steps"][2]["finish_reasons"]["solo"] = "stop"
    assert "step 2" in _failed(_vllm(), lab)[FINISHED]


@pytest.mark.parametrize("field, value, shown", [
    ("finish_reasons", ["length"], "solo: vLLM [('stop', 14)] vs lab [('length', 14)]"),
    ("stop_reasons", [None], "solo: vLLM [('stop', 14)] vs lab [('stop', None)]"),
])
def test_another_finish_or_stop_reason_fails(field, value, shown):
    lab = _lab()
    lab["requests"]["solo"][field] = value
    assert _failed(_vllm(), lab)[REASONS] == shown


def test_a_child_stop_reason_is_compared_per_completion():
    lab = _lab()
    lab["requests"]["kids"]["stop_reasons"] = [None, 8]
    assert "kids: vLLM [('length', None), ('length', None)] vs lab [('length', None), ('length', 8)]" \
        in _failed(_vllm(), lab)[REASONS]


def test_a_watermark_that_did_not_reach_one_side_fails():
    lab = _lab()
    lab["settings"] = {"watermark": 0.0, "watermark_blocks": 0}
    assert _failed(_vllm(), lab)[WATERMARK] == "vLLM (0.25, 2) vs lab (0.0, 0)"


def test_inputs_are_not_changed():
    vllm, lab = _vllm(), _lab()
    before = copy.deepcopy((vllm, lab))
    compare(vllm, lab)
    assert (vllm, lab) == before


def test_the_driver_picks_its_events_port_below_the_ephemeral_range():
    """The driver's SUB connects (and zmq re-connects every 100 ms) before vLLM's publisher binds; a port from
    the kernel's ephemeral range can become the source port of one of those tries (a TCP self-connect), and the
    bind then fails "Address already in use" (a CI run lost all 30 conformance tests to it). The port is below
    the range, and free."""
    import socket

    from peer import vllm_driver

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    for _ in range(20):
        port = vllm_driver._free_port_outside_ephemeral_range()
        assert 1024 <= port < low, port
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))

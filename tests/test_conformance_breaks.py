"""The conformance comparisons catch a lab broken on purpose: the lab's V1 mode is run with one rule
changed and compared with vLLM's record of the same case (``peer.conformance.run_vllm``, cached case by
case, so this shares vLLM's runs with ``tests/test_conformance.py``), and the check for that rule must fail,
naming the difference. Each break is a plausible bug:

- the length limit tested before stop tokens (vLLM's ``check_stop`` tests stop tokens first);
- the priority victim among tied requests taken last in running order instead of first
  (vLLM: ``max(self.running, key=...)`` keeps the first maximum): as many preemptions in the same step,
  another request preempted, which the count of preemptions alone did not show;
- the case's watermark not passed to the lab (what ``peer/lab_runner.py`` did before it passed one).
"""

from __future__ import annotations

import dataclasses

import pytest

from engine import EMBEDDED_MODEL
from engine.scheduler import Scheduler
from engine.scheduler_v1 import SchedulerV1
from peer import conformance
from peer.cases import build_cases
from peer.compare import compare
from peer.lab_runner import run_case

pytestmark = [pytest.mark.peer, pytest.mark.slow]


@pytest.fixture(scope="module")
def loaded():
    why = conformance.peer_available()
    if why:
        pytest.skip(f"vLLM is not installed here: {why}")
    import torch

    from engine.model_loader import load_model
    return load_model(EMBEDDED_MODEL, torch.device("cpu"), "float32")


def _checks(loaded, name: str, edit=lambda case: case) -> dict[str, str]:
    """Failed checks (name -> detail) of case ``name``: vLLM as is, the lab on ``edit(case)``."""
    tok = loaded[1]
    case = next(c for c in build_cases(lambda t: tok(t, add_special_tokens=False)["input_ids"],
                                       vocab_size=loaded[0].config.vocab_size) if c.name == name)
    try:
        vllm = conformance.run_vllm({"model": EMBEDDED_MODEL, "cases": [case.spec()]})
    except conformance.PeerUnavailable as exc:
        pytest.fail(f"the vLLM peer is installed but failed: {exc}")
    lab = run_case(edit(case), EMBEDDED_MODEL, loaded=loaded)
    return {c.name: c.detail for c in compare(vllm["cases"][name], lab) if not c.ok}


def test_length_tested_before_stop_tokens_is_caught(loaded, monkeypatch):
    assert _checks(loaded, "finish-reasons-B32") == {}  # the case passes unbroken
    original = Scheduler._finish_reason  # the scheduler's update_from_output decides a finish (SchedulerV1's too)

    def length_first(self, req, seq, token):
        return "length" if seq.num_tokens >= req.max_len else original(self, req, seq, token)

    monkeypatch.setattr(Scheduler, "_finish_reason", length_first)
    failed = _checks(loaded, "finish-reasons-B32")
    assert set(failed) == {"same requests finished, step by step, with the same finish_reason",
                           "same finish_reason and stop_reason per completion"}, failed
    assert "('stop-at-limit', 'stop')] vs lab" in failed["same requests finished, step by step, with the same finish_reason"]
    assert "stop-at-limit: vLLM [('stop', 14)] vs lab [('length', None)]" \
        in failed["same finish_reason and stop_reason per completion"]


def test_another_victim_among_tied_priorities_is_caught(loaded, monkeypatch):
    def last_among_ties(self):
        if self.policy == "priority":
            return max(reversed(self.running), key=lambda r: (r.priority, r.arrival))
        return self.running[-1]

    monkeypatch.setattr(SchedulerV1, "_victim", last_among_ties)
    failed = _checks(loaded, "priority-children-B32")
    detail = failed["same requests preempted, in the same order, step by step"]
    assert "vLLM ['kids#0'] vs lab ['kids#2']" in detail, detail


def test_a_watermark_left_out_of_the_lab_is_caught(loaded):
    failed = _checks(loaded, "watermark-B32", lambda case: dataclasses.replace(case, watermark=0.0))
    assert failed["same watermark applied (share, blocks kept free)"] == "vLLM (0.25, 2) vs lab (0.0, 0)"
    assert "step 1:" in failed["same tokens scheduled per request, step by step"]

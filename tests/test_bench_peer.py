"""bench/peer.py: the workloads it sends to both engines, the lab's side of a run, and (marked ``peer``) one
small real run of vLLM (``peer/vllm_bench.py`` in ``.peer-venv``) against the lab with identical outputs."""

from __future__ import annotations

import pytest

from bench import peer as bp


@pytest.fixture(scope="module")
def loaded():
    return bp.load_lab_model()


@pytest.fixture(scope="module")
def tokenize(loaded):
    return bp.tokenizer_fn(loaded)


def _tiny(n: int = 2) -> bp.BenchWorkload:
    reqs = [bp.BenchRequest([5 + i, 17, 33, 250, 1000 + i, 7, 9], 6 + i) for i in range(n)]
    return bp.BenchWorkload("tiny", reqs, block_size=32, num_blocks=16, max_model_len=256)


def test_shared_system_prompt_workload(tokenize):
    wl = bp.shared_system_prompt(tokenize)
    assert len(wl.requests) == 36
    assert (wl.block_size, wl.num_blocks, wl.max_model_len) == (32, 1024, 512)
    shared = [r for r in wl.requests if r.shared_prefix]
    assert len(shared) == 18
    sys_len = shared[0].shared_prefix
    assert 70 <= sys_len <= 90
    system = shared[0].prompt_token_ids[:sys_len]
    for r in wl.requests:
        assert 3 <= len(r.prompt_token_ids) <= 160
        assert 48 <= r.max_tokens <= 64
        assert all(0 <= t < 2048 for t in r.prompt_token_ids)
        if r.shared_prefix:  # the shared prefix really is shared, and followed by a user part
            assert r.shared_prefix == sys_len and r.prompt_token_ids[:sys_len] == system
            assert len(r.prompt_token_ids) >= sys_len + 3
        else:
            assert r.prompt_token_ids[:sys_len] != system
    # deterministic, and the seed matters
    again = bp.shared_system_prompt(tokenize)
    assert [(r.prompt_token_ids, r.max_tokens) for r in again.requests] == \
           [(r.prompt_token_ids, r.max_tokens) for r in wl.requests]
    other = bp.shared_system_prompt(tokenize, seed=1)
    assert [r.prompt_token_ids for r in other.requests] != [r.prompt_token_ids for r in wl.requests]


def test_chat_workload_is_the_scenario_greedy(tokenize):
    from engine.scenarios.presets import get_scenario

    wl = bp.chat_workload(tokenize)
    scenario = get_scenario("chat-workload").make(0, tokenize)
    assert [r.prompt_token_ids for r in wl.requests] == [list(r.prompt) for r in scenario.requests]
    assert [r.max_tokens for r in wl.requests] == [r.params.max_tokens for r in scenario.requests]
    # the scenario's 2,048 slots, in blocks vLLM's CPU attention accepts (a multiple of 32)
    assert wl.block_size % 32 == 0 and wl.block_size * wl.num_blocks == 16 * 128
    assert wl.max_model_len == 512
    assert bp.chat_workload(tokenize).requests == wl.requests


def test_long_context_workload(tokenize):
    wl = bp.long_context(tokenize)
    assert len(wl.requests) == 8
    assert all(len(r.prompt_token_ids) == 1500 and r.max_tokens == 64 for r in wl.requests)
    assert (wl.block_size, wl.max_model_len) == (32, 2048)
    need = sum(-(-(1500 + 64) // 32) for _ in wl.requests)
    assert wl.num_blocks >= need  # no memory pressure
    firsts = {tuple(r.prompt_token_ids[:32]) for r in wl.requests}
    assert len(firsts) == 8  # no shared first block
    assert bp.long_context(tokenize).requests == wl.requests


def test_lab_run_returns_sane_numbers(loaded):
    wl = _tiny(2)
    on = bp.run_lab(wl, loaded, threads=1, records=True)
    off = bp.run_lab(wl, loaded, threads=1, records=False)
    for r in (on, off):
        assert r["tokens"] == wl.total_output_tokens == 13
        assert [len(o) for o in r["outputs"]] == [6, 7]
        assert r["steps"] >= 7 and r["wall_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["wall_s"])
        assert r["steps_per_s"] == pytest.approx(r["steps"] / r["wall_s"])
        assert 0 < r["ttft_median_s"] <= r["ttft_p90_s"] <= r["wall_s"]
        assert r["threads"] == 1
    assert on["records_kept"] == on["steps"] and off["records_kept"] == 0
    assert on["outputs"] == off["outputs"]  # greedy: the same tokens


def test_table_row_puts_each_engine_in_its_column():
    def run(tps, steps_per_s, ttft):
        return {"tokens_per_s": tps, "steps_per_s": steps_per_s, "steps": 10, "ttft_median_s": ttft,
                "ttft_p90_s": 2 * ttft}

    m = {"workload": "w", "threads": 1, "identical": 3, "requests": 4,
         "runs": {"vllm": [run(400, 40, 0.004)], "lab_records": [run(100, 10, 0.001)],
                  "lab_no_records": [run(200, 20, 0.002)]}}
    cells = [c.strip() for c in bp.table_row("quiet", 0.5, m).split("|")[1:-1]]
    assert len(cells) == len(bp.TABLE_HEAD[1].split("|")) - 2
    assert cells[3:11] == ["100", "200", "400", "0.25", "10 / 40", "10 / 10", "1 / 4", "2 / 8"]
    assert cells[11] == "3 of 4"


def test_percentile():
    assert bp._percentile([1.0], 90) == 1.0
    assert bp._percentile([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0], 90) == 10.0


def test_missing_peer_env_says_how_to_build_it(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bp, "PEER_PYTHON", tmp_path / "no-venv" / "bin" / "python")
    assert bp.main(["--runs", "1", "--cases", "quiet", "--workloads", "long-context"]) == 2
    assert "bash scripts/setup_peer.sh" in capsys.readouterr().err


@pytest.mark.peer
@pytest.mark.slow
def test_vllm_and_lab_produce_identical_outputs(loaded, tmp_path):
    why = bp.peer_missing()
    if why:
        pytest.skip(f"vLLM is not installed here: {why}")
    wl = _tiny(3)
    vllm = bp.VllmPeer(str(bp.ROOT / "assets" / "tiny_model"), 1, tmp_path / "vllm.log")
    try:
        built = vllm.build(wl)
        assert built["settings"]["block_size"] == 32 and built["settings"]["num_gpu_blocks"] == wl.num_blocks + 1
        assert built["settings"]["enable_prefix_caching"] and built["settings"]["max_num_seqs"] == 256
        res = vllm.run(threads=1)
        again = vllm.run(threads=1)  # after reset_prefix_cache(): the same run
    finally:
        vllm.close()
    assert vllm.proc.poll() is not None
    lab = bp.run_lab(wl, loaded, threads=1, records=True)
    assert res["tokens"] == lab["tokens"] == wl.total_output_tokens
    assert res["threads"] == 1 and res["steps"] == lab["steps"]
    assert res["outputs"] == lab["outputs"] == again["outputs"]
    assert 0 < res["ttft_median_s"] <= res["wall_s"]

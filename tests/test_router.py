"""The KV-aware router's view (issue 27, item 2): a prompt's cached prefix per server by vLLM's rules, and the
server Dynamo's KV router cost would choose; ``python -m engine route``; the Server page's panel.

Mirrors are fed the lab's own events (hashes as hex strings); the CLI reads a capture of two lab publishers
as two named servers (``test_watch_servers``), and the shipped vLLM capture."""

from __future__ import annotations

import io
import json
from argparse import Namespace
from pathlib import Path

import pytest

from engine import metrics
from engine.watch.cache_mirror import PrefixCacheMirror
from engine.watch.router import cached_prefix, parse_ids, route
from engine.watch.servers import parse_servers

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "assets" / "captures" / "vllm-shared-prefix.jsonl"


def h(i: int) -> str:
    return format(i, "064x")


def stored(hashes: list[int], parent: int | None, tokens: list[int], block_size: int = 2) -> dict:
    return {"type": "BlockStored", "block_hashes": [h(x) for x in hashes],
            "parent_block_hash": None if parent is None else h(parent), "token_ids": tokens,
            "block_size": block_size, "lora_id": None, "medium": "GPU"}


def mirror_of(*batches: list[dict], rank: int = 0) -> PrefixCacheMirror:
    m = PrefixCacheMirror(rank=rank)
    for seq, events in enumerate(batches):
        m.apply(seq, 1000.0 + seq, events)
    return m


# a chain [1,2][3,4][5,6] (hashes 1, 2, 3) and, under hash 1, a sibling [7,8] (hash 4); a block [5,6] whose
# parent is not [1,2][3,4] (hash 5 under 4), and a root [9,9] (hash 6)
CHAIN = mirror_of([stored([1, 2, 3], None, [1, 2, 3, 4, 5, 6])], [stored([4], 1, [7, 8])],
                  [stored([5], 4, [5, 6])], [stored([6], None, [9, 9])])


@pytest.mark.parametrize("ids, blocks, matched", [
    ([1, 2, 3, 4, 5, 6, 0], 3, 3),        # three whole blocks, a token past them: all three
    ([1, 2, 3, 4, 5, 6], 2, 3),           # exactly three blocks: the last token is never cached -> 2
    ([1, 2, 3, 4, 5], 2, 2),              # a partial block never counts
    ([1, 2, 7, 8, 5, 6, 0], 3, 3),        # the sibling branch, then [5,6] under it (hash 5): its own chain
    ([1, 2, 0, 0, 5, 6, 0], 1, 1),        # stops at the first miss though [5,6] is cached elsewhere
    ([3, 4, 5, 6, 0], 0, 0),              # [3,4] is cached only under [1,2]: chained hashes, no match
    ([9, 9], 0, 1),                       # one block, cached, but it is the whole prompt: 0
    ([9], 0, 0),
])
def test_cached_prefix_follows_vllms_rules(ids, blocks, matched):
    m = cached_prefix(CHAIN, ids)
    assert (m.blocks, m.matched_blocks, m.tokens) == (blocks, matched, blocks * 2)
    assert len(m.hashes) == blocks


def test_the_choice_is_dynamos_cost_not_only_the_overlap():
    servers = parse_servers(["a=tcp://127.0.0.1:1", "b=tcp://127.0.0.1:2", "c=tcp://127.0.0.1:3"])
    mirrors = {0: CHAIN, 1: mirror_of([stored([1], None, [1, 2])], rank=1), 2: PrefixCacheMirror(rank=2)}
    ids = [1, 2, 3, 4, 5, 6, 0, 0]  # 8 tokens = 4 blocks of 2
    r = route(servers, mirrors, ids)
    assert {n: r["servers"][n]["cached_prefix_tokens"] for n in "abc"} == {"a": 6, "b": 2, "c": 0}
    # no /metrics anywhere: load unknown (0 active blocks), so the most cached wins; prefill (8 - 6) / 2 = 1,
    # decode = the request's own 4 blocks
    assert r["choice"] == "a" and r["servers"]["a"]["cost"] == 1 + 4 and not r["servers"]["a"]["load_known"]
    # a busy a: 10 of its 10 usable blocks held by running requests -> cost 1 + 14 = 15 > b's 3 + 4 = 7
    busy = {"kv_cache_usage": 1.0, "num_gpu_blocks": 11}
    r = route(servers, mirrors, ids, {"a": busy})
    assert metrics.active_blocks(busy) == 10
    assert r["servers"]["a"]["decode_blocks"] == 14 and r["servers"]["a"]["cost"] == 15 and r["choice"] == "b"
    # the weight: prefill counted 10x makes a's cache worth its load again (10 x 1 + 14 = 24 < 10 x 3 + 4 = 34)
    assert route(servers, mirrors, ids, {"a": busy}, overlap_score_weight=10)["choice"] == "a"


def test_ties_go_to_more_cached_tokens_then_the_first_given():
    servers = parse_servers(["x=tcp://127.0.0.1:1", "y=tcp://127.0.0.1:2"])
    empty = {0: PrefixCacheMirror(rank=0), 1: PrefixCacheMirror(rank=1)}
    assert route(servers, empty, [1, 2, 3])["choice"] == "x"
    assert route(list(reversed(servers)), empty, [1, 2, 3])["choice"] == "y"


def test_a_data_parallel_server_is_scored_by_its_best_rank():
    servers = parse_servers(["dp=tcp://127.0.0.1:1,tcp://127.0.0.1:2"])
    r = route(servers, {0: PrefixCacheMirror(rank=0), 1: CHAIN}, [1, 2, 3, 4, 0])
    assert r["servers"]["dp"]["rank"] == 1 and r["servers"]["dp"]["cached_prefix_blocks"] == 2


@pytest.mark.parametrize("text, said", [
    ("1,x,3", "'x' is not a token id"), ("", "the prompt is empty"), ("1,-2", "token 1 of the prompt is -2"),
])
def test_bad_prompt_ids_are_named(text, said):
    with pytest.raises(ValueError, match=said):
        parse_ids(text)


def test_a_prompt_too_long_is_named():
    from engine.watch import router

    with pytest.raises(ValueError, match=f"the prompt is {router.MAX_PROMPT_TOKENS + 1:,} tokens, more than"):
        route(parse_servers(["a=tcp://127.0.0.1:1"]), {}, [1] * (router.MAX_PROMPT_TOKENS + 1))


# ----------------------------------------------------------------------------------------------- the CLI
def route_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    from engine.cli import main

    rc = main(["route", *argv])
    got = capsys.readouterr()
    return rc, got.out, got.err


def test_route_json_on_the_shipped_vllm_capture(capsys):
    from engine.watch.router import from_capture

    _, mirrors, _ = from_capture(str(SHIPPED))
    m = mirrors[0]
    deepest = max(m.blocks, key=lambda x: len(m.prefix_tokens(x)))
    ids = m.prefix_tokens(deepest)  # a whole cached chain: the last-token rule leaves one block out
    rc, out, err = route_cli(["--capture", str(SHIPPED), "--prompt-ids", ",".join(map(str, ids)), "--json"], capsys)
    assert rc == 0, err
    got = json.loads(out)
    row = got["servers"]["server"]
    n = len(ids) // 32
    assert got["choice"] == "server" and row["matched_blocks"] == n
    assert (row["cached_prefix_blocks"], row["cached_prefix_tokens"]) == (n - 1, (n - 1) * 32)
    assert row["load_known"] and row["active_blocks"] == 0  # the capture's last /metrics: nothing running
    rc, out, _ = route_cli(["--capture", str(SHIPPED), "--prompt-ids", ",".join(map(str, ids + [7]))], capsys)
    assert f"server: cached prefix {n * 32:,} tokens = {n} blocks of 32" in out  # n > 1
    assert "a KV-aware router would send it to: server" in out and "Dynamo" in out


def test_route_reads_a_capture_of_two_named_servers(two_servers, capsys):
    _, path = two_servers
    rc, out, err = route_cli(["--capture", str(path), "--prompt-ids", "1,2,3,4,5,6,0", "--json"], capsys)
    got = json.loads(out)
    assert rc == 0 and set(got["servers"]) == {"vllm", "lab"}
    # vllm holds [1,2][3,4][5,6]; lab holds [1,2]: 6 tokens against 2
    assert got["servers"]["vllm"]["cached_prefix_tokens"] == 6 and got["servers"]["lab"]["cached_prefix_tokens"] == 2
    # vllm's /metrics says 30% of 10 usable blocks are held (3 active): 0.5 + 3 + 4 = 7.5 against lab's 2.5 + 4
    assert got["servers"]["vllm"]["cost"] == 7.5 and got["servers"]["lab"]["cost"] == 6.5
    assert got["choice"] == "lab"


@pytest.mark.parametrize("argv, said", [
    (["--capture", "nope.jsonl", "--prompt-ids", "1"], "capture 'nope.jsonl': no such file"),
    (["--capture", str(SHIPPED), "--prompt-ids", "1,two"], "'two' is not a token id"),
    (["--capture", str(SHIPPED), "--prompt", "hello"], "--prompt needs --tokenizer"),
    (["--server", "vllm", "--prompt-ids", "1"], "--server 'vllm': expected NAME=ENDPOINT"),
    (["--server", "a=tcp://127.0.0.1:1", "--metrics", "b=http://127.0.0.1:2/metrics", "--prompt-ids", "1"],
     "no --server is named 'b'"),
    (["--server", "a=tcp://127.0.0.1:9", "--prompt-ids", "1", "--wait", "0.5"],
     "no server's KV events could be read within --wait 0.5 s (tcp://127.0.0.1:9: "),
])
def test_route_bad_input_is_one_line_naming_the_value(argv, said, capsys):
    rc, _, err = route_cli(argv, capsys)
    assert rc == 2 and said in err and "Traceback" not in err


def test_route_text_prompt_with_the_tokenizer(capsys):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ROOT / "assets" / "tiny_model"))
    text = "ROMEO. But soft, what light"
    rc, out, _ = route_cli(["--capture", str(SHIPPED), "--prompt", text, "--tokenizer",
                            str(ROOT / "assets" / "tiny_model"), "--json"], capsys)
    assert rc == 0 and json.loads(out)["prompt_tokens"] == len(tok(text)["input_ids"])


from test_watch_servers import metrics_url, two_servers  # noqa: E402,F401  (module fixtures)


# ---------------------------------------------------------------------------------------------- the page
def test_the_page_shows_two_servers_each_with_its_pool_and_the_router_panel(metrics_url):
    from engine.kv_publisher import KVEventPublisher
    from test_ui_server import charts, connect, new_app, rerun_until, shown, texts

    at = new_app("Live server")
    try:
        with KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") as a, \
                KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") as b:
            a.publish([stored([1, 2], None, [1, 2, 3, 4])])
            a.publish([stored([3], 2, [5, 6])])
            b.publish([stored([9], None, [1, 2])])
            connect(at, f"vllm={a.endpoint}; lab={b.endpoint}", f"vllm={a.replay_endpoint}; lab={b.replay_endpoint}",
                    f"vllm={metrics_url}")
            assert rerun_until(at, lambda x: len(shown(x)) == 2 and shown(x)[0]["cached blocks"] == "3"
                               and shown(x)[1]["cached blocks"] == "1"
                               and any(m.label == "pool (blocks)" for m in x.metric)), shown(at)
            vllm, lab = shown(at)
            # each its own: vLLM's share of its own 10 usable blocks; the lab (no /metrics) has no share at all
            assert vllm["share of pool"] == f"{metrics.cached_share_pct(3, 11):.1f}%" == "30.0%"
            assert "share of pool" not in lab and lab["stored / removed"] == "1 / 0"
            assert "#### vllm" in texts(at) and "#### lab" in texts(at) and "rank 1" not in texts(at)
            assert "no /metrics URL" in texts(at)
            trees = [c for c in charts(at) if c["layout"]["title"]["text"].split(":")[0] in ("vllm", "lab")]
            assert [t["layout"]["title"]["text"].split(":")[0] for t in trees] == ["vllm", "lab"]
            # the router panel: ids pasted, the cached prefix per server, the choice, the rings in the trees
            at.radio(key="live_router_kind").set_value("token ids")
            at.text_area(key="live_router_prompt").set_value("1, 2, 3, 4, 5, 6, 0").run()
            assert not at.exception
            table = next(m.value for m in at.markdown if m.value.startswith("| server |"))
            assert "| vllm | 6 of 7 | 3 |" in table and "| 2 of 7 | 1 |" in table
            assert "would send it to **lab**" in texts(at)  # vllm's load (3 active blocks) outweighs its cache
            ringed = {t["layout"]["title"]["text"].split(":")[0]: t["data"][-1]["name"] == "cached prefix"
                      and len(t["data"][-1]["x"]) for t in charts(at) if "cached prefix" in json.dumps(t["data"])}
            assert ringed == {"vllm": 3, "lab": 1}
            at.text_area(key="live_router_prompt").set_value("1, x").run()
            assert any("Router view: " in e.value and "'x' is not a token id" in e.value for e in at.error)
    finally:
        live = at.session_state["server_live"] if "server_live" in at.session_state else None
        if live is not None:
            live.stop()

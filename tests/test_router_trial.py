"""The router view after the no-context operator trial (issue 27 follow-ups): a down server is not a
candidate, servers with different block sizes are costed in one unit, a late joiner's mirror says it may be
incomplete."""

from __future__ import annotations

import json
import socket

from engine.watch.cache_mirror import PrefixCacheMirror
from engine.watch.router import lines, route

UNREACHABLE = "unreachable: not a candidate"
from engine.watch.servers import parse_servers

from test_router import h, mirror_of, route_cli, stored


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------- 1. a down server is no candidate
def test_an_unreachable_server_is_not_a_candidate():
    servers = parse_servers(["down=tcp://127.0.0.1:1", "up=tcp://127.0.0.1:2"])
    mirrors = {0: PrefixCacheMirror(rank=0), 1: PrefixCacheMirror(rank=1)}
    # both empty: equal cost, and the first given would win the tie; down cannot
    r = route(servers, mirrors, [1, 2, 3], unavailable={0: "tcp://127.0.0.1:1: unreachable"})
    assert r["choice"] == "up"
    down = r["servers"]["down"]
    assert down["reachable"] is False and down["candidate"] is False and down["cost"] is None
    assert down["why_not"].startswith(UNREACHABLE) and r["servers"]["up"]["reachable"] is True
    assert down["block_size"] is None  # not another server's
    text = "\n".join(lines(r))
    assert f"down: {UNREACHABLE}" in text and "block size unknown" in text
    # nothing reachable: no choice at all
    r = route(servers, mirrors, [1, 2, 3], unavailable={0: "x", 1: "y"})
    assert r["choice"] is None and "no server is a candidate" in "\n".join(lines(r))


def test_route_cli_live_excludes_the_down_server(capsys):
    from engine.kv_publisher import KVEventPublisher

    with KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") as lab:
        lab.publish([stored([1], None, [1, 2])])
        down = f"tcp://127.0.0.1:{free_port()}"
        argv = ["--server", f"down={down}", "--server", f"lab={lab.endpoint}", "--replay",
                f"lab={lab.replay_endpoint}", "--prompt-ids", "7,7,7", "--wait", "1"]
        rc, out, err = route_cli(argv + ["--json"], capsys)
        assert rc == 0, err
        got = json.loads(out)
        assert got["choice"] == "lab"
        assert got["servers"]["down"]["reachable"] is False and got["servers"]["down"]["candidate"] is False
        rc, out, err = route_cli(argv, capsys)
        assert f"down: {UNREACHABLE}" in out and "would send it to: lab" in out


# --------------------------------------------------------------- 2. different block sizes, one cost unit
def test_more_cached_tokens_with_equal_load_never_loses_across_block_sizes():
    ids = list(range(1, 100))  # 99 tokens
    lab = PrefixCacheMirror(rank=0)  # blocks of 16: 5 blocks = 80 tokens cached
    parent = None
    for i in range(5):
        lab.apply(i, 1000.0 + i, [{**stored([i + 1], parent, ids[i * 16:(i + 1) * 16], 16)}])
        parent = i + 1
    vllm = mirror_of([stored([50], None, [0] * 32, 32)], rank=1)  # blocks of 32, nothing of the prompt
    servers = parse_servers(["lab=tcp://127.0.0.1:1", "vllm=tcp://127.0.0.1:2"])
    r = route(servers, {0: lab, 1: vllm}, ids)
    assert r["servers"]["lab"]["cached_prefix_tokens"] == 80 and r["servers"]["vllm"]["cached_prefix_tokens"] == 0
    assert r["cost_block_size"] == 16
    assert (r["servers"]["lab"]["block_size"], r["servers"]["vllm"]["block_size"]) == (16, 32)
    # in blocks of 16: lab 19/16 + ceil(99/16) = 8.1875; vllm 99/16 + 7 = 13.1875
    assert r["servers"]["lab"]["cost"] == 8.1875 and r["servers"]["vllm"]["cost"] == 13.1875
    assert r["choice"] == "lab"
    # given in the other order, the same
    assert route(list(reversed(servers)), {0: lab, 1: vllm}, ids)["choice"] == "lab"


def test_active_blocks_count_in_the_servers_own_block_size():
    servers = parse_servers(["a=tcp://127.0.0.1:1", "b=tcp://127.0.0.1:2"])
    a = mirror_of([stored([1], None, [5] * 16, 16)], rank=0)
    b = mirror_of([stored([2], None, [6] * 32, 32)], rank=1)
    # each holds 2 active blocks: 32 tokens on a, 64 on b -> 2 and 4 blocks of 16
    busy = {"kv_cache_usage": 0.2, "num_gpu_blocks": 11}
    r = route(servers, {0: a, 1: b}, [1, 2, 3], {"a": busy, "b": busy})
    assert r["servers"]["a"]["decode_blocks"] == 2 + 1 and r["servers"]["b"]["decode_blocks"] == 4 + 1


# -------------------------------------------------------------------- 3. a late joiner may be incomplete
def test_a_late_joiners_cache_is_said_to_be_incomplete():
    servers = parse_servers(["late=tcp://127.0.0.1:1", "whole=tcp://127.0.0.1:2", "none=tcp://127.0.0.1:3"])
    late = PrefixCacheMirror(rank=0)
    late.apply(7, 1000.0, [stored([1], None, [1, 2])])
    whole = mirror_of([stored([2], None, [1, 2])], rank=1)
    r = route(servers, {0: late, 1: whole, 2: PrefixCacheMirror(rank=2)}, [1, 2, 3])
    assert r["servers"]["late"]["incomplete"].startswith("cache seen from batch 7: blocks stored before are unknown")
    assert r["servers"]["whole"]["incomplete"] is None
    assert r["servers"]["none"]["incomplete"].startswith("no batch seen")
    assert "note: cache seen from batch 7" in "\n".join(lines(r))


def test_route_cli_without_replay_says_the_cache_may_be_incomplete(capsys):
    from engine.kv_publisher import KVEventPublisher

    with KVEventPublisher("tcp://127.0.0.1:0") as lab:
        lab.publish([stored([1], None, [1, 2])])  # before the route joins: never seen
        assert lab.flush()  # handed to ZMQ before the route subscribes
        rc, out, err = route_cli(["--server", f"lab={lab.endpoint}", "--prompt-ids", "1,2,3", "--wait", "0.5",
                                  "--json"], capsys)
    assert rc == 0, err
    got = json.loads(out)
    assert got["servers"]["lab"]["incomplete"].startswith("no batch seen")
    assert any("lab: no batch seen" in p for p in got["problems"])


def test_the_page_router_panel_excludes_a_down_server():
    from engine.kv_publisher import KVEventPublisher
    from test_ui_server import connect, new_app, rerun_until, shown, texts

    at = new_app("Live server")
    try:
        with KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") as lab:
            lab.publish([stored([1], None, [1, 2])])
            down = f"tcp://127.0.0.1:{free_port()}"
            connect(at, f"down={down}; lab={lab.endpoint}", f"lab={lab.replay_endpoint}", "")
            assert rerun_until(at, lambda x: len(shown(x)) == 2 and shown(x)[1]["cached blocks"] == "1"
                               and "unreachable" in texts(x)), texts(at)
            at.radio(key="live_router_kind").set_value("token ids")
            at.text_area(key="live_router_prompt").set_value("7, 7, 7").run()
            assert not at.exception
            table = next(m.value for m in at.markdown if m.value.startswith("| server |"))
            assert f"| down | {UNREACHABLE}" in table
            assert "would send it to **lab**" in texts(at)
    finally:
        live = at.session_state["server_live"] if "server_live" in at.session_state else None
        if live is not None:
            live.stop()


# ------------------------------------------------------------ 4. a prompt longer than a server takes
def test_a_prompt_longer_than_the_servers_max_model_len_is_not_routed_there():
    servers = parse_servers(["small=tcp://127.0.0.1:1", "big=tcp://127.0.0.1:2"])
    mirrors = {0: PrefixCacheMirror(rank=0), 1: PrefixCacheMirror(rank=1)}
    r = route(servers, mirrors, [1] * 10, {"small": {"max_model_len": 8}, "big": {"max_model_len": 64}})
    assert r["choice"] == "big" and not r["servers"]["small"]["candidate"]
    assert "the prompt is 10 tokens, more than 8 (max_model_len from its /metrics)" in r["servers"]["small"]["why_not"]
    r = route(servers, mirrors, [1] * 10, model_limit=(9, "the tokenizer"))
    assert r["choice"] is None and all(not x["candidate"] for x in r["servers"].values())


def test_max_model_len_is_read_from_an_info_gauge():
    from engine.watch.server_metrics import parse_metrics

    text = ('# TYPE vllm:model_config_info gauge\nvllm:model_config_info{max_model_len="4096",model="m"} 1.0\n'
            '# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size="32",num_gpu_blocks="99"} 1.0\n')
    assert parse_metrics(text) == {"max_model_len": 4096, "block_size": 32, "num_gpu_blocks": 99}


def test_route_cli_a_text_prompt_past_the_models_length(capfd):
    from engine.cli import main
    from test_router import ROOT, SHIPPED

    folder = str(ROOT / "assets" / "tiny_model")
    text = "ROMEO. But soft, what light " * 400  # well past the tiny model's 2,048 tokens
    rc = main(["route", "--capture", str(SHIPPED), "--prompt", text, "--tokenizer", folder, "--json"])
    out, err = capfd.readouterr()  # the fds: transformers' logger writes to the stderr it was set up with
    assert rc == 0, err
    got = json.loads(out)
    row = got["servers"]["server"]
    assert got["prompt_tokens"] > 2048 and not row["candidate"] and got["choice"] is None
    assert "more than 2,048 (the tokenizer's model_max_length" in row["why_not"]
    assert "Token indices sequence length" not in err


def test_route_cli_prompt_ids_beyond_the_vocabulary(capsys):
    from test_router import ROOT, SHIPPED

    rc, _, err = route_cli(["--capture", str(SHIPPED), "--prompt-ids", "1,999999", "--tokenizer",
                            str(ROOT / "assets" / "tiny_model")], capsys)
    assert rc == 2 and "token 1 is 999999, beyond the vocabulary of 2,048 ids" in err


def test_the_page_router_panel_refuses_a_text_prompt_past_the_model():
    from engine.kv_publisher import KVEventPublisher
    from test_ui_server import connect, new_app, rerun_until, shown, texts

    at = new_app("Live server")
    try:
        with KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") as lab:
            lab.publish([stored([1], None, [1, 2])])
            connect(at, f"lab={lab.endpoint}", f"lab={lab.replay_endpoint}", "")
            assert rerun_until(at, lambda x: len(shown(x)) == 1 and shown(x)[0]["cached blocks"] == "1"), texts(at)
            at.radio(key="live_router_kind").set_value("text")
            at.text_area(key="live_router_prompt").set_value("ROMEO. But soft, what light " * 400).run()
            assert not at.exception
            table = next(m.value for m in at.markdown if m.value.startswith("| server |"))
            assert "| lab | cannot take it: the prompt is" in table and "more than 2,048" in table
            assert "No server is a candidate" in " ".join(w.value for w in at.warning)
    finally:
        live = at.session_state["server_live"] if "server_live" in at.session_state else None
        if live is not None:
            live.stop()

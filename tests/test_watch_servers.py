"""Several servers watched side by side (issue 27, item 1): ``python -m engine watch --server NAME=ENDPOINT``,
each server's own pool and counters, captures that keep the names, and the positional form unchanged.

Two lab publishers (``engine.kv_publisher.KVEventPublisher``, vLLM's framing) play two servers; a tiny HTTP
server answers one server's /metrics in vLLM's format. Everything on 127.0.0.1."""

from __future__ import annotations

import io
import json
from argparse import Namespace

import pytest
from metrics_http import serve_metrics

from engine.kv_publisher import KVEventPublisher
from engine.watch import servers as sv
from engine.watch.capture import read_capture, server_pool
from engine.watch.command import replay as replay_cli
from engine.watch.command import servers_of_args
from engine.watch.command import watch as watch_cli

METRICS_TEXT = """# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="2",num_gpu_blocks="11"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.3
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 200.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 50.0
"""


def stored(hashes: list[int], parent: int | None, tokens: list[int], block_size: int = 2) -> dict:
    return {"type": "BlockStored", "block_hashes": [format(h, "064x") for h in hashes],
            "parent_block_hash": None if parent is None else format(parent, "064x"), "token_ids": tokens,
            "block_size": block_size, "lora_id": None, "medium": "GPU"}


@pytest.fixture(scope="module")
def metrics_url():
    with serve_metrics(lambda: METRICS_TEXT) as url:
        yield url


def args(**kw) -> Namespace:
    base = {"endpoints": [], "server": [], "replay": [], "metrics": [], "replay_endpoint": [], "topic": "",
            "record": None, "duration": None, "max_batches": None, "tokenizer": None, "metrics_port": None}
    return Namespace(**{**base, **kw})


# ------------------------------------------------------------------------------------------- the forms
def test_server_flags_parse_into_named_servers_with_global_stream_numbers():
    specs = sv.parse_servers(["vllm=tcp://127.0.0.1:5557,tcp://127.0.0.1:5558", "lab=tcp://127.0.0.1:6557"],
                             ["lab=tcp://127.0.0.1:6558"], ["vllm=http://127.0.0.1:8000/metrics"])
    assert [(s.name, s.streams) for s in specs] == [("vllm", [0, 1]), ("lab", [2])]
    assert specs[0].replays == [None, None] and specs[1].replays == ["tcp://127.0.0.1:6558"]
    assert specs[0].metrics_url == "http://127.0.0.1:8000/metrics" and specs[1].metrics_url is None
    assert [specs[0].label(1, False), specs[1].label(2, False)] == ["vllm rank 1", "lab"]
    one = servers_of_args(args(endpoints=["tcp://127.0.0.1:5557"], metrics=["http://127.0.0.1:8000/metrics"]))
    assert one[0].name == "server" and one[0].label(0, True) == "rank 0"  # the positional form reads as before


@pytest.mark.parametrize("flags, said", [
    ({"server": ["vllm"]}, "--server 'vllm': expected NAME=ENDPOINT"),
    ({"server": ["bad name=tcp://127.0.0.1:1"]}, "server name 'bad name'"),
    ({"server": ["a=tcp://127.0.0.1:1", "a=tcp://127.0.0.1:2"]}, "the name 'a' is given twice"),
    ({"server": ["a=http://127.0.0.1:1"]}, "'http://127.0.0.1:1'"),
    ({"server": ["a=tcp://127.0.0.1:1"], "replay": ["b=tcp://127.0.0.1:2"]}, "no --server is named 'b'"),
    ({"server": ["a=tcp://127.0.0.1:1"], "metrics": ["b=http://x/metrics"]}, "no --server is named 'b'"),
    ({"server": ["a=tcp://127.0.0.1:1"], "metrics": ["a=x:8000/metrics"]}, "'x:8000/metrics' must start with http"),
    ({"server": ["a=tcp://127.0.0.1:1"], "replay": ["a=tcp://127.0.0.1:2,tcp://127.0.0.1:3"]},
     "2 replay endpoint(s) for the 1 endpoint(s) of server 'a'"),
    ({"server": ["a=tcp://127.0.0.1:1"], "endpoints": ["tcp://127.0.0.1:2"]}, "not both"),
    ({}, "no server given"),
])
def test_a_bad_server_flag_is_named(flags, said):
    with pytest.raises(ValueError) as e:
        servers_of_args(args(**flags))
    assert said in str(e.value)


def test_the_cli_says_a_malformed_server_in_one_line(capsys):
    from engine.cli import main

    assert main(["watch", "--server", "vllm", "--duration", "1"]) == 2
    assert "error: --server 'vllm': expected NAME=ENDPOINT" in capsys.readouterr().err


def test_the_page_reads_the_same_forms():
    specs = sv.parse_page("vllm=tcp://127.0.0.1:5557; lab=tcp://127.0.0.1:6557", "lab=tcp://127.0.0.1:6558",
                          "vllm=http://127.0.0.1:8000/metrics")
    assert [s.name for s in specs] == ["vllm", "lab"] and specs[1].replays == ["tcp://127.0.0.1:6558"]
    one = sv.parse_page("tcp://127.0.0.1:5557, tcp://127.0.0.1:5559", "", "http://127.0.0.1:8000/metrics")
    assert len(one) == 1 and one[0].endpoints == ["tcp://127.0.0.1:5557", "tcp://127.0.0.1:5559"]
    with pytest.raises(ValueError, match="'tcp://127.0.0.1:6557' has no NAME="):
        sv.parse_page("vllm=tcp://127.0.0.1:5557; tcp://127.0.0.1:6557")


# ------------------------------------------------------------------------------- two servers, watched
@pytest.fixture(scope="module")
def two_servers(metrics_url, tmp_path_factory):
    """Two publishers as two servers ("vllm": 3 blocks, with /metrics; "lab": 1 block, none), watched with
    --server and --record; returns (output, capture path)."""
    path = tmp_path_factory.mktemp("cap") / "two.jsonl"
    with KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") as a, \
            KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") as b:
        a.publish([stored([1, 2], None, [1, 2, 3, 4])])
        a.publish([stored([3], 2, [5, 6])])
        b.publish([stored([9], None, [1, 2])])
        a.flush(), b.flush()
        out = io.StringIO()
        assert watch_cli(args(server=[f"vllm={a.endpoint}", f"lab={b.endpoint}"],
                              replay=[f"vllm={a.replay_endpoint}", f"lab={b.replay_endpoint}"],
                              metrics=[f"vllm={metrics_url}"], record=str(path), max_batches=3, duration=20),
                         out=out) == 0
    return out.getvalue(), path


def test_each_server_has_its_own_pool_and_counters(two_servers):
    text, _ = two_servers
    assert "server vllm: " in text and "pool 11 blocks, KV cache usage 30.0%, prefix cache hit rate 25.0%" in text
    # vLLM's share is of its own pool (11 blocks = 10 usable); the lab has no /metrics, so no share at all
    assert "vllm: 3 cached blocks (3 distinct) = 6 tokens, 30.0% of its pool of 10 usable blocks" in text
    lab = next(line for line in text.splitlines() if line.startswith("lab: "))
    assert lab.startswith("lab: 1 cached blocks (1 distinct) = 2 tokens, 1 prefix roots") and "pool" not in lab
    assert "rank 1" not in text  # the lab is not a rank of the vLLM server


def test_a_capture_keeps_the_server_names_and_replays_them(two_servers):
    text, path = two_servers
    capture = read_capture(path)
    assert [(s["name"], s["streams"]) for s in capture.header["servers"]] == [("vllm", [0]), ("lab", [1])]
    assert server_pool(capture, "vllm") == 11 and server_pool(capture, "lab") is None
    assert all(m.get("server") == "vllm" for m in capture.metrics) and capture.metrics
    out = io.StringIO()
    assert replay_cli(Namespace(file=str(path), speed=0.0, tokenizer=None), out=out) == 0
    replayed = out.getvalue()
    assert "servers vllm (streams 0), lab (streams 1)" in replayed
    for line in text.splitlines():  # the final state reads the same live and replayed
        if line.startswith(("vllm: ", "lab: ")):
            assert line in replayed


def test_a_capture_header_with_bad_servers_is_refused_naming_it(tmp_path):
    from engine.watch.capture import new_header

    for servers, said in ([{"name": "a b", "streams": [0]}], "'name' must be a distinct server name"), \
                         ([{"name": "a", "streams": [0]}, {"name": "b", "streams": [0]}], "'b': 'streams'"):
        p = tmp_path / "bad.jsonl"
        p.write_text(json.dumps({**new_header("t", []), "servers": servers}) + "\n")
        with pytest.raises(ValueError, match=said):
            read_capture(p)


def test_the_positional_form_and_an_old_capture_still_read_as_one_server(tmp_path):
    from pathlib import Path

    shipped = Path(__file__).resolve().parent.parent / "assets" / "captures" / "vllm-shared-prefix.jsonl"
    out = io.StringIO()
    assert replay_cli(Namespace(file=str(shipped), speed=0.0, tokenizer=None), out=out) == 0
    text = out.getvalue()
    assert "ranks [0]" in text and "\nrank 0: " in text and "server server" not in text
    # its pool (the header's 25 blocks) is its own: the share is printed against 24 usable blocks
    assert "% of its pool of 24 usable blocks" in text

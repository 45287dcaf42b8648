"""Big pools (issue 27, item 5): a pool of 10^5 blocks grouped by root prefix and drawn (within a second:
``bench.watch_groups``, docs/benchmarks.md section ``watch-groups``), the
top prefixes by blocks held and by reuse, and storage tiers (``medium``) shown apart."""

from __future__ import annotations

import io
from argparse import Namespace

import pytest

from engine.watch.cache_mirror import PrefixCacheMirror
from engine.watch.groups import root_groups, roots_of, tiers, tiers_line, top_extended


def h(i: int) -> str:
    return format(i, "064x")


def stored(hashes: list[int], parent: int | None, tokens: list[int], block_size: int = 2,
           medium: str = "GPU") -> dict:
    return {"type": "BlockStored", "block_hashes": [h(x) for x in hashes],
            "parent_block_hash": None if parent is None else h(parent), "token_ids": tokens,
            "block_size": block_size, "lora_id": None, "medium": medium}


def removed(hashes: list[int], medium: str = "GPU") -> dict:
    return {"type": "BlockRemoved", "block_hashes": [h(x) for x in hashes], "medium": medium}


@pytest.fixture(scope="module")
def big():
    """102,000 blocks: 100 system prompts of 10 blocks, each extended by 20 to 182 conversations of 10 blocks
    (prompt p by 20 + 18 x (p mod 10)): the largest trees hold 10 + 182 x 10 blocks (``bench.watch_groups``
    times grouping and drawing this pool: docs/benchmarks.md, section ``watch-groups``)."""
    from bench.watch_groups import big_pool

    return big_pool()


def test_a_pool_of_100000_blocks_is_grouped_and_drawn(big):
    """What the grouping and the figure say; how fast: ``bench.watch_groups`` (a speed goal is a benchmark's,
    not a timed test's)."""
    from viz.server import groups_figure

    assert big.num_blocks >= 100_000
    groups = root_groups(big)
    fig = groups_figure(big, top=20, groups=groups)
    assert len(groups) == 100 and sum(g.blocks for g in groups) == big.num_blocks
    assert groups[0].blocks == 10 + 182 * 10 and groups[0].extended == 182 and groups[0].depth == 20
    assert [b.y for b in fig.data][0][0].startswith("1. ") and len(fig.data[0].y) == 20
    assert "in 100 prefix trees (the 20 largest of 100), by root prefix" in fig.layout.title.text
    # the top prefixes by reuse: the system prompts' last blocks, most extended first
    top = top_extended(big, 3)
    assert [n for _, n in top] == [182, 182, 182] and all(roots_of(big)[x][1] == 10 for x, _ in top)


def test_the_cli_names_the_largest_trees_of_a_big_pool(big):
    from engine.watch.command import state_lines

    lines = state_lines(big)
    assert any(line.startswith("  largest prefix trees: ") and "1,830 blocks (extended 182 times)" in line
               for line in lines)


def test_tiers_are_kept_per_copy_and_shown_apart():
    m = PrefixCacheMirror()
    m.apply(0, 1.0, [stored([1, 2], None, [1, 2, 3, 4])])
    m.apply(1, 2.0, [stored([1, 2], None, [1, 2, 3, 4], medium="CPU")])  # offloaded: a CPU copy of each
    m.apply(2, 3.0, [removed([1, 2])])                                   # the GPU copies evicted
    assert tiers(m) == {"CPU": 2} and m.blocks[h(1)].medium == "CPU" and m.num_blocks == 2
    m.apply(3, 4.0, [stored([3], None, [9, 9])])
    assert tiers(m) == {"CPU": 2, "GPU": 1} and tiers_line(tiers(m)) == "CPU 2 blocks · GPU 1 blocks"
    from viz.server import groups_figure

    fig = groups_figure(m)
    assert [t.name for t in fig.data] == ["GPU", "CPU"] and fig.data[0].showlegend
    one = PrefixCacheMirror()
    one.apply(0, 1.0, [stored([1], None, [1, 2])])
    assert tiers_line(tiers(one)) == ""  # one tier: nothing to tell apart


def test_the_page_draws_a_big_pool_by_root_prefix_and_its_tiers():
    from engine.kv_publisher import KVEventPublisher
    from test_ui_server import charts, connect, new_app, rerun_until, shown, texts

    at = new_app("Live server")
    try:
        with KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") as pub:
            events, n = [], 1
            for p in range(30):  # 30 prompts of 60 blocks: 1,800 blocks, more than the tree draws
                events.append(stored(list(range(n, n + 60)), None, [p] * 120, medium="GPU" if p else "CPU"))
                n += 60
            pub.publish(events)
            pub.publish([stored([n], 60, [7, 7])])  # extends prompt 0's last block
            connect(at, pub.endpoint, pub.replay_endpoint)
            assert rerun_until(at, lambda x: shown(x) and shown(x)[0]["cached blocks"] == "1,801"), shown(at)
        titles = [c["layout"]["title"]["text"] for c in charts(at)]
        assert titles[0].startswith("rank 0: 1,801 prefixes in 30 trees")  # the capped tree first, as before
        grouped = next(c for c in charts(at) if "by root prefix" in c["layout"]["title"]["text"])
        assert "1,801 blocks in 30 prefix trees (the 20 largest of 30)" in grouped["layout"]["title"]["text"]
        assert [d["name"] for d in grouped["data"]] == ["GPU", "CPU"]
        assert "storage tiers (the events' medium): GPU 1,741 blocks · CPU 60 blocks" in texts(at)
        assert "extended 1 time: 120 tokens, ending" in texts(at)
    finally:
        live = at.session_state["server_live"] if "server_live" in at.session_state else None
        if live is not None:
            live.stop()

"""Server: a real LLM server's prefix cache, rebuilt from its KV cache events, live or from a capture.

Live: one ``engine.watch.kv_subscriber.KVEventSubscriber`` per endpoint (one per data-parallel rank), made on
Connect and kept in this browser session's ``st.session_state["server_live"]``; its background thread
receives and applies the batches, and the view below re-reads ``view()`` on a timer (``st.fragment(
run_every=...)``), so the page never waits on the network. A session holds at most one set: Connect to other
endpoints stops the old set first, Stop stops it, and a process-wide registry (``st.cache_resource``) stops
the set of a session whose browser tab went away (reload, closed tab), so no thread outlives its viewer.
An optional ``/metrics`` URL is read by a poller thread of the same set every 2 s.

Replay: a capture (``engine.watch.capture``: a shipped one under ``assets/captures/`` or an upload) stepped batch
by batch with ``CaptureReplay.state(k)``: Step / Back, a scrub slider over positions, Play at a speed.

Every number is read from the mirrors (``engine.watch.cache_mirror``), ``engine.metrics`` and the server's
``/metrics`` through ``viz.server.rank_numbers`` / ``server_numbers``; the figures are ``viz.server``'s.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import streamlit as st

from engine import EMBEDDED_MODEL
from infra import class_limits as limits
from engine.watch.capture import (CaptureReplay, capture_from_raw, dumps_capture, new_header, read_capture,
                                  server_pool, server_scrapes, server_time)
from engine.watch.kv_subscriber import MAX_CAPTURE_BYTES, KVEventSubscriber
from engine.watch.server_metrics import MetricsPoller as _Poller
from engine.watch.exporter import hit_rate_window
from engine.watch.rates import WINDOW_S
from engine.watch.router import check_prompt, parse_ids, route
from engine.watch.servers import ServerSpec, one_server, parse_page, servers_of_capture
from engine.watch.cache_mirror import hash_labels
from engine.watch.groups import tiers, tiers_line, top_extended
from viz.server import MAX_TREE_BLOCKS, groups_figure, rates_figure, rates_line
from viz.server import (STREAM_COUNTS_HELP, VLLM_EVENTS_FLAG, plural, batch_activity_figure, batch_line,
                        cache_size_figure, groups_line, mirror_warnings, prefix_tree_figure, rank_numbers,
                        server_numbers, state_line, stream_caption)

ROOT = Path(__file__).resolve().parent.parent
CAPTURES = ROOT / "assets" / "captures"
# the endpoints `bash scripts/serve_vllm.sh` serves (peer/vllm_server.py's defaults), so Connect just works
DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
DEFAULT_REPLAY = "tcp://127.0.0.1:5558"
DEFAULT_METRICS = "http://127.0.0.1:8000/metrics"
REFRESH_S = 1.0          # the live view re-reads the subscribers this often
METRICS_EVERY_S = 2.0    # the /metrics poller's period
MAX_SCRAPES = 10_000     # /metrics scrapes kept for a downloaded capture
SPEEDS = [1, 2, 5, 10, 25, 50]  # replay speeds, batches per second
MODES = ["Live server", "Replay a capture"]
COLOR_BY = {"age": "age (seconds since stored)", "root": "root prefix (one colour per tree)"}
VLLM_COMMAND = f"python -m vllm.entrypoints.openai.api_server --model DIR \\\n    {VLLM_EVENTS_FLAG}"

INTRO = (
    "A server with automatic prefix caching keeps the KV blocks of prompts it has seen and publishes every "
    "change over ZMQ, batch by batch, in vLLM's schema: **BlockStored** (full blocks cached, with their tokens "
    "and parent hash), **BlockRemoved** (evicted when the pool needed them) and **AllBlocksCleared** (the "
    "prefix cache was reset). This page reads a **real server's** KV events, live or from a capture, so it "
    "shows vLLM V1's semantics, not the lab's engine; vLLM sends them when started with `--kv-events-config`.")


# ------------------------------------------------------------------------------------------ live: state
def MetricsPoller(url: str):  # noqa: N802 - the engine's poller, at this page's period
    return _Poller(url, every_s=METRICS_EVERY_S, max_scrapes=MAX_SCRAPES)


@dataclass
class LiveSet:
    """One session's subscribers (one per endpoint: ``rank`` = the stream's number over all servers) and one
    /metrics poller per server that has a URL (``pollers``: name -> poller). ``servers`` says which streams
    are whose (``engine.watch.servers``); a set made from bare endpoints is one server."""
    endpoints: list[str]
    replays: list[str | None]
    subs: list
    poller: object | None = None       # one server's poller (kept for a set of one server)
    started: float = field(default_factory=time.time)
    running: bool = True
    servers: list[ServerSpec] | None = None
    pollers: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.servers is None:
            self.servers = one_server(self.endpoints, [r for r in self.replays if r] or None,
                                      getattr(self.poller, "url", None))
        if self.poller is not None and not self.pollers:
            self.pollers = {self.servers[0].name: self.poller}

    def stop(self) -> None:
        for s in self.subs:
            s.stop()
        for p in self.pollers.values():
            p.stop()
        self.running = False

    def num_gpu_blocks(self, name: str | None = None) -> int | None:
        """Server ``name``'s pool size from its own /metrics (default: the first server's)."""
        poller = self.pollers.get(name or self.servers[0].name)
        values = poller.latest()[0] if poller else None
        return (values or {}).get("num_gpu_blocks")

    @property
    def named(self) -> bool:
        return not (len(self.servers) == 1 and self.servers[0].name == "server")

    def capture_cut(self) -> str | None:
        """None, or how the capture was cut: each subscriber keeps at most 50,000 batches and 64 MiB of
        payloads (``kv_subscriber.MAX_CAPTURE_BYTES``), dropping the oldest first."""
        dropped = sum(s.capture_dropped for s in self.subs)
        if not dropped:
            return None
        return (f"the capture was cut: the first {plural(dropped, 'batch was', 'batches were')} dropped (each "
                f"subscriber keeps at most 50,000 batches and {MAX_CAPTURE_BYTES // 2**20} MiB of payloads)")

    def capture_text(self) -> str:
        """What was received so far as a capture (``engine.watch.capture``'s JSON lines), with the /metrics
        scrapes and, for named servers, each server's name, streams and pool; what "Download capture" sends."""
        raws = [r for s in self.subs for r in s.capture_items()]  # batches and markers (what a replay counts)
        notes = [self.capture_cut()] if self.capture_cut() else []
        block_sizes = {s.view().mirror.block_size for s in self.subs} - {None}
        header = new_header("the Server page (live)", self.endpoints,
                            block_size=block_sizes.pop() if len(block_sizes) == 1 else None,
                            num_gpu_blocks=None if self.named else self.num_gpu_blocks(), notes=notes)
        header["markers"] = True  # the stream's counts are in marker lines (engine.watch.capture)
        if self.named:
            header["servers"] = [sv.header(self.num_gpu_blocks(sv.name)) for sv in self.servers]
        capture = capture_from_raw(raws, header)
        if raws:
            t0 = min(r.recv_ts for r in raws)
            for name, poller in self.pollers.items():
                for at, values in poller.history():
                    if at >= t0:
                        line = {"rank": 0, "t": round(at - t0, 6), "at": at, "values": values}
                        if self.named:
                            line["server"] = name
                        capture.metrics.append(line)
            capture.metrics.sort(key=lambda m: m["t"])
        return dumps_capture(capture)


class _SessionToken:
    """Lives in one session's state; when the session is gone its finalizer stops that session's sets."""


@st.cache_resource
def live_registry() -> dict:
    """Process-wide: browser session id -> its LiveSet, and a lock; read by ``sweep``."""
    return {"lock": threading.Lock(), "sets": {}}


def session_id() -> str:
    from streamlit.runtime.scriptrunner import get_script_run_ctx

    ctx = get_script_run_ctx()
    return ctx.session_id if ctx is not None else "no-session"


def sweep() -> None:
    """Stop the sets of sessions whose browser tab is gone (a reload opens a new session; a closed tab
    leaves its session behind): no subscriber thread outlives its viewer."""
    try:
        from streamlit.runtime import Runtime

        runtime = Runtime.instance() if Runtime.exists() else None
    except Exception:  # no runtime (AppTest, bare mode): nothing to sweep
        runtime = None
    if runtime is None:
        return
    registry = live_registry()
    with registry["lock"]:
        for sid in [sid for sid in registry["sets"] if not runtime.is_active_session(sid)]:
            registry["sets"].pop(sid).stop()


def connect() -> None:
    """Connect's callback: validate, stop this session's old set, start one subscriber per endpoint and one
    /metrics poller per server that has a URL. Several servers are written ``NAME=ENDPOINT[,ENDPOINT...]``,
    separated by ``;`` (``engine.watch.servers.parse_page``, the CLI's ``--server`` form)."""
    text = st.session_state.get("server_endpoints", "")
    replays_text = st.session_state.get("server_replays", "")
    url = st.session_state.get("server_metrics_url", "").strip()
    old = st.session_state.get("server_live")
    still = (f" Still watching {', '.join(old.endpoints)}." if old is not None and old.running else "")
    try:
        servers = parse_page(text, replays_text, url)
    except ValueError as exc:
        st.session_state["server_error"] = "Not connected: " + _page_words(str(exc)) + "." + still
        return
    endpoints = [e for sv in servers for e in sv.endpoints]
    replays = [r for sv in servers for r in sv.replays]
    urls = {sv.name: sv.metrics_url for sv in servers if sv.metrics_url}
    if old is not None and old.running and old.endpoints == endpoints and old.replays == replays \
            and [sv.name for sv in old.servers] == [sv.name for sv in servers]:
        if {n: p.url for n, p in old.pollers.items()} != urls:  # same streams, other /metrics: keep the streams
            for p in old.pollers.values():
                p.stop()
            old.pollers = {n: MetricsPoller(u).start() for n, u in urls.items()}
            old.servers = servers
        st.session_state["server_flash"] = f"Already connected to {', '.join(endpoints)}; Stop first to start afresh."
        return
    registry = live_registry()
    sid = session_id()
    with registry["lock"]:
        if old is not None:
            old.stop()
        registry["sets"].pop(sid, None)
        subs = []
        try:
            for sv in servers:
                for stream, e, r in zip(sv.streams, sv.endpoints, sv.replays):
                    subs.append(KVEventSubscriber(e, r, rank=stream))
        except ValueError as exc:  # the old set stays on screen, stopped: what it received is not lost
            for s in subs:
                s.stop()
            st.session_state["server_error"] = f"Not connected: {exc}."
            return
        live = LiveSet(endpoints, replays, subs, servers=servers,
                       pollers={n: MetricsPoller(u).start() for n, u in urls.items()})
        registry["sets"][sid] = live
    # when this session's state is dropped (its tab gone and no page run left to sweep it), stop its threads;
    # one finalizer per session, for the current set only (an old one would keep an old set's mirrors alive)
    token = st.session_state.setdefault("server_token", _SessionToken())
    if (previous := st.session_state.get("server_finalizer")) is not None:
        previous.detach()
    st.session_state["server_finalizer"] = weakref.finalize(token, live.stop)
    st.session_state["server_live"] = live


def _page_words(text: str) -> str:
    """The parser's words as this page's fields name them (the CLI's flags are the page's fields)."""
    for flag, field_name in (("--replay-endpoint(s)", "replay endpoint(s)"), ("--metrics '", "/metrics URL '"), ("--server", "server"),
                             ("--replay", "replay endpoints"), ("--metrics", "/metrics URL"),
                             ("ENDPOINT", "endpoint")):
        text = text.replace(flag, field_name)
    if text.startswith("no KV events endpoint given"):
        text += f": type one per data-parallel rank, e.g. {DEFAULT_ENDPOINT}"
    return text


def stop() -> None:
    live = st.session_state.get("server_live")
    if live is None:
        return
    live.stop()
    registry = live_registry()
    with registry["lock"]:
        if registry["sets"].get(session_id()) is live:
            registry["sets"].pop(session_id())


# ---------------------------------------------------------------------------------------- shared views
@st.cache_resource(show_spinner="Loading the tokenizer...")
def load_tokenizer(folder: str):
    from engine.model_loader import transformers_api  # the import lock: a model may be loading in the background

    return transformers_api().AutoTokenizer.from_pretrained(folder)


def decoder():
    """token ids -> text with the tokenizer folder of the sidebar, or None (with a warning saying why)."""
    folder = st.session_state.get("server_tokenizer", EMBEDDED_MODEL).strip()
    if not folder:
        return None
    if not Path(folder).is_dir():
        st.sidebar.warning(f"Tokenizer folder {folder!r} does not exist; blocks show token ids only.")
        return None
    try:
        limits.check_model(folder)  # a class server reads only the folders it serves (and caches each once)
        tok = load_tokenizer(folder)
    except Exception as exc:  # any loader failure is a message, never a traceback
        st.sidebar.warning(f"No tokenizer could be loaded from {folder!r} ({type(exc).__name__}: "
                           f"{str(exc)[:200]}); blocks show token ids only.")
        return None
    return lambda ids: tok.decode(ids)


def server_row(values: dict | None, error: str | None, source: str, narrow: bool = False,
               scrapes: list | None = None) -> None:
    """The server's own numbers from /metrics (live) or the capture's scrapes (replay); ``narrow``: in a
    column beside another server's (the five numbers in two rows, none cut at 1400 px); ``scrapes``: (time,
    values) read so far, for the hit rate over the last window (``engine.metrics.windowed_hit_rate_pct``)."""
    if error and values is None:
        st.warning(f"/metrics unreachable: {error}. The KV events do not depend on it.")
        return
    if values is None:
        st.caption(f"/metrics: {source}")
        return
    n = server_numbers(values)
    st.markdown("**The server's own counters** (/metrics)")
    cols = (st.columns(3) + st.columns(3)) if narrow else st.columns(6)
    cols[0].metric("KV cache usage", "-" if n["kv_cache_usage_pct"] is None else f"{n['kv_cache_usage_pct']:.1f}%",
                   help="vllm:kv_cache_usage_perc: blocks held by running requests over the usable pool. Cached "
                        "blocks that no running request holds count as free (they are evicted when needed), so "
                        "this can read 0% while the prefix cache fills the pool (engine.metrics."
                        "server_kv_usage_pct)")
    cols[1].metric("prefix cache hit rate", "-" if n["hit_rate_pct"] is None else f"{n['hit_rate_pct']:.1f}%",
                   help="vllm:prefix_cache_hits / vllm:prefix_cache_queries, in tokens, first admissions "
                        "(engine.metrics.server_hit_rate_pct)")
    cols[2].metric("preemptions", "-" if n["preemptions"] is None else f"{n['preemptions']:,}")
    cols[3].metric("running / waiting", f"{'-' if n['running'] is None else n['running']} / "
                                        f"{'-' if n['waiting'] is None else n['waiting']}")
    cols[4].metric("pool (blocks)", "-" if n["num_gpu_blocks"] is None else f"{n['num_gpu_blocks']:,}",
                   help="vllm:cache_config_info's num_gpu_blocks, which counts vLLM's null block (never cached)")
    window = hit_rate_window(scrapes or [])
    cols[5].metric(f"hit rate, last {WINDOW_S:.0f} s", "-" if window is None else f"{window:.1f}%",
                   help="the prefix cache hit rate between the newest /metrics read and the one a window earlier "
                        "(hits and queries deltas, engine.metrics.windowed_hit_rate_pct): '-' when no query came "
                        "in the window")
    if error:
        st.caption(f"/metrics: the last read failed ({error}); showing the one before")
    else:
        st.caption(f"/metrics: {source}")


def rank_panel(mirror, decode, num_gpu_blocks: int | None, key: str, wide: bool, label: str | None = None,
               highlight: list[str] | None = None, scrapes: list | None = None) -> None:
    """One stream's numbers and figures (the same live and in a replay); ``num_gpu_blocks``: its own server's
    pool; ``label``: how it is named; ``highlight``: the router panel's cached prefix, ringed in the tree."""
    for warning in mirror_warnings(mirror):  # the cache below is not (all of) the server's: say so first
        st.warning(warning)
    n = rank_numbers(mirror, num_gpu_blocks)
    # one rank: the numbers stacked beside the tree (the tree stays in a projector's first screen); several
    # ranks: a row of numbers above each rank's tree
    if wide:
        tree_place, numbers_place = st.columns([4.2, 1])
    else:
        numbers_place, tree_place = st.container(), st.container()
    with numbers_place:
        cols = [st.container() for _ in range(3)] if wide else st.columns(3)
    cols[0].metric("cached blocks", f"{n['blocks']:,}",
                   help=("every KV cache group's together (one block per group a hash is cached in): "
                         if n["groups"] else "") +
                        f"physical KV blocks holding a cached prefix (a hash held twice counts twice): "
                        f"{plural(n['prefixes'], 'distinct prefix', 'distinct prefixes')} in "
                        f"{plural(n['roots'], 'tree')}; stored {n['stored']:,} and removed {n['removed']:,} over "
                        f"{plural(n['batches'], 'batch', 'batches')}")
    cols[1].metric("tokens", f"{n['tokens']:,}", help=f"cached blocks x block size ({n['block_size'] or '-'})")
    share = n["pool_share_pct"]
    if share is not None:
        cols[2].metric("share of pool", f"{share:.1f}%",
                       help="cached blocks over the pool's usable blocks (num_gpu_blocks - 1: vLLM's null block is "
                            "never cached), engine.metrics.cached_share_pct")
    else:  # the pool's size comes only with /metrics or a capture header that has it
        cols[2].metric("stored / removed", f"{n['stored']:,} / {n['removed']:,}",
                       help=f"blocks stored and removed over {n['batches']:,} batches. The share of the pool needs "
                            f"the pool's size (num_gpu_blocks), from /metrics or the capture's header.")
    if groups_line(n):  # a hybrid server: which group each count is (vLLM's group_idx)
        numbers_place.caption(groups_line(n))
    color_by = st.session_state.get("server_color_by", "age")
    counts = tiers(mirror)
    if tiers_line(counts):
        st.caption(f"storage tiers (the events' medium): {tiers_line(counts)}")
    tree_place.plotly_chart(prefix_tree_figure(mirror, decode=decode, color_by=color_by, label=label,
                                               highlight=highlight), width="stretch", key=f"{key}_tree")
    if len(mirror.blocks) > MAX_TREE_BLOCKS:  # the tree shows the latest 1,500: the whole pool by root prefix
        tree_place.plotly_chart(groups_figure(mirror, decode, label=label), width="stretch", key=f"{key}_groups")
        top = top_extended(mirror, 8)
        if top:
            name = hash_labels([h for h, _ in top])
            with tree_place.expander(f"Top prefixes by reuse ({len(top)})"):
                st.markdown("\n".join(
                    f"- `{name[h]}` extended {plural(n, 'time')}: {_prefix_words(mirror, h, decode)}" for h, n in top))
    st.caption(rates_line(mirror.history),
               help="Over the last minute of the server's own clock (the batches' ts): blocks evicted and stored "
                    "per second, how long the evicted blocks had been cached, and hot prefixes evicted (a block "
                    "that 3 or more requests went on past in the last 60 s: engine.watch.cache_mirror)")
    figs = [batch_activity_figure(mirror.history), cache_size_figure(mirror.history, num_gpu_blocks)]
    places = st.columns(2) if wide else [st.container(), st.container()]
    for i, (place, fig) in enumerate(zip(places, figs)):
        with place:
            st.plotly_chart(fig, width="stretch", key=f"{key}_fig{i}")
    # folded: a figure redrawn every second only when asked for (the caption above says the last minute)
    with st.expander("Rates over time (the server's clock): evictions / s, age at eviction, hit rate"):
        st.plotly_chart(rates_figure(mirror.history, _server_clock(mirror, scrapes)), width="stretch",
                        key=f"{key}_rates")
    notes = list(mirror.notes)
    if mirror.unknown_removals:
        notes.append(f"{mirror.unknown_removals:,} removals of blocks this view never saw stored (stored before "
                     f"the watch began, or in a lost batch)")
    if mirror.orphan_stores:
        notes.append(f"{mirror.orphan_stores:,} stores whose parent block this view does not hold (evicted, or "
                     f"stored before the watch began): drawn as roots")
    if notes:
        with st.expander(f"notes ({len(notes)})"):
            st.markdown("\n".join(f"- {x}" for x in notes[-50:]))


# ------------------------------------------------------------------------------------------ live: views
def live_controls() -> None:
    """The endpoints and Connect / Stop at the top of the page (on the first screen at 1280x720); the
    replay endpoints and /metrics, filled with the demo server's, folded below."""
    c = st.columns([5, 1, 1], vertical_alignment="bottom")
    c[0].text_input("KV events endpoints", DEFAULT_ENDPOINT, key="server_endpoints",
                    help="The server's ZMQ PUB endpoint(s), one per data-parallel rank, comma separated (vLLM "
                         "binds the endpoint's port plus the rank). Connect to the server's host: the config's "
                         "tcp://*:5557 is read at tcp://HOST:5557. Several servers: name each, separated by ';', "
                         "e.g. vllm=tcp://127.0.0.1:5557; lab=tcp://127.0.0.1:6557 (the same NAME= in the "
                         "replay and /metrics fields: vllm=http://127.0.0.1:8000/metrics).")
    c[1].button("Connect", type="primary", on_click=connect, width="stretch",
                help="Start one subscriber per endpoint (stopping this tab's previous ones)")
    c[2].button("Stop", on_click=stop, width="stretch", help="Stop receiving; what was received stays on screen")
    with st.expander("Replay endpoints and /metrics"):
        st.text_input("Replay endpoints (optional)", DEFAULT_REPLAY, key="server_replays",
                      help="The replay (ROUTER) endpoint of each, in the same order, comma separated: batches "
                           "missed while connecting or in a gap are asked for there. Empty: none. Named servers: "
                           "NAME=ENDPOINT[,ENDPOINT...] per server, separated by ';'.")
        st.text_input("/metrics URL (optional)", DEFAULT_METRICS, key="server_metrics_url",
                      help="The server's Prometheus /metrics: the pool's size, KV cache usage, its own hit rate. "
                           "Empty: none. Named servers: NAME=URL per server, separated by ';' (each server's "
                           "pool and counters are its own).")


def live_mode() -> None:
    if err := st.session_state.pop("server_error", None):
        st.error(err)
    if msg := st.session_state.pop("server_flash", None):
        st.toast(msg, icon=":material/info:")
    live = st.session_state.get("server_live")
    if live is None:
        st.info(f"Not connected. Type the server's KV events endpoint(s) above (default "
                f"{DEFAULT_ENDPOINT}) and press **Connect**. Without vLLM, the lab's own engine publishes in "
                f"vLLM's format: `python -m engine run --scenario shared-prefix --semantics v1 "
                f"--kv-events-endpoint tcp://127.0.0.1:5557 --kv-events-replay-endpoint tcp://127.0.0.1:5558 "
                f"--step-delay 0.3`.")
        return
    st.fragment(run_every=REFRESH_S if live.running else None)(live_view)(live)
    # outside the timer: its data is made when clicked (what was received by then), and a button re-made
    # every second could lose the click
    cut = live.capture_cut()
    if cut:
        st.caption(cut[0].upper() + cut[1:] + ": a replay of it starts later than this view.")
    st.download_button("Download capture", live.capture_text, file_name="kv_capture.jsonl",
                       mime="application/jsonl", key="server_download", on_click="ignore",
                       help="Everything received so far (and the /metrics scrapes) as a capture to replay here "
                            "or with `python -m engine replay FILE`")


def live_view(live: LiveSet) -> None:
    """Re-run on a timer while connected: read each subscriber's view and draw it, server by server, each
    with its own pool size and /metrics."""
    sweep()
    decode = decoder_cached()
    views = {s.rank: s.view() for s in live.subs}
    now = time.time()
    tiles = [(sv, stream) for sv in live.servers for stream in sv.streams]
    single = len(live.servers) == 1
    mirrors = {k: v.mirror for k, v in views.items()}
    down = {k: f"{v.endpoint}: {v.state}" for k, v in views.items()
            if v.state in ("unreachable", "not_publisher", "connecting")}
    routed = router_panel(live.servers, mirrors, {n: p.latest()[0] for n, p in live.pollers.items()
                                                  if p.latest()[0] is not None}, "live", unavailable=down)
    for col, (sv, stream) in zip(tile_columns(len(tiles)), tiles):
        v = views[stream]
        with col:
            name = sv.label(stream, single)
            if live.named and stream == sv.streams[0]:
                server_header(sv, live.pollers.get(sv.name), now, narrow=len(tiles) > 1)
            line = state_line(v, now)
            if v.state in ("unreachable", "not_publisher", "disconnected"):  # to act on: a box that stands out
                st.markdown(f"**{name}** `{v.endpoint}`")
                (st.warning if v.state == "disconnected" else st.error)(line)
            else:  # one line, so the tree stays in the first screen
                color = {"live": "green", "idle": "orange", "stopped": "gray"}.get(v.state, "blue")
                st.markdown(f"**{name}** `{v.endpoint}` :{color}-background[{line}]")
            st.caption(stream_caption(v), help=STREAM_COUNTS_HELP)  # the view's own counts, named
            if v.last_error and v.last_error != line:
                st.warning(f"last error: {v.last_error}")
            poller = live.pollers.get(sv.name)
            rank_panel(v.mirror, decode, live.num_gpu_blocks(sv.name), f"live{stream}", wide=len(tiles) == 1,
                       label=name, highlight=routed.get(stream), scrapes=poller.history() if poller else None)
    if not live.named and live.pollers:
        poller = next(iter(live.pollers.values()))
        values, error, at = poller.latest()
        source = f"{poller.url}, read {max(0.0, now - at):.0f} s ago" if at else f"{poller.url}: reading..."
        server_row(values, error, source, scrapes=poller.history())
    registry = live_registry()
    with registry["lock"]:
        sets = [s for s in registry["sets"].values() if s.running]
    st.caption(f"This app process watches {sum(len(s.subs) for s in sets)} endpoint(s) for {len(sets)} browser "
               f"session(s); a closed or reloaded tab's subscribers are stopped.")


def server_header(sv: ServerSpec, poller, now: float, narrow: bool) -> None:
    """A named server's name, endpoints and its own /metrics, above its first rank."""
    st.markdown(f"#### {sv.name}")
    if poller is None:
        st.caption("no /metrics URL: the pool's size and the server's own counters are unknown")
        return
    values, error, at = poller.latest()
    source = f"{poller.url}, read {max(0.0, now - at):.0f} s ago" if at else f"{poller.url}: reading..."
    server_row(values, error, source, narrow=narrow, scrapes=poller.history())


def _prefix_words(mirror, h: str, decode) -> str:
    """A cached block as the prefix it ends: its length and its last words (or ids)."""
    ids = mirror.prefix_tokens(h)
    if decode is None:
        return f"{len(ids):,} tokens, ending {ids[-8:]}"
    try:
        return f"{len(ids):,} tokens, ending {decode(ids[-16:])!r}"
    except Exception:  # a tokenizer that cannot decode these ids
        return f"{len(ids):,} tokens, ending {ids[-8:]}"


def _server_clock(mirror, scrapes: list | None) -> list | None:
    """/metrics reads ((epoch seconds, values)) on the rates figure's axis: seconds since the mirror's first
    batch (the server's ts; this machine's and the server's clocks are taken to agree)."""
    if not scrapes or not mirror.history:
        return None
    t0 = mirror.history[0].ts
    return [(at - t0, values) for at, values in scrapes]


def tile_columns(n: int) -> list:
    """Side-by-side columns for n streams, at most 2 to a row: at 1400 px three columns cut the numbers and
    the figure titles."""
    cols = []
    for start in range(0, n, 2):
        cols += st.columns(min(2, n - start))
    return cols


# ------------------------------------------------------------------------------------------ router view
ROUTER_HELP = ("Per server, the longest prefix of the prompt its KV events say is cached, by vLLM's rules (whole "
               "blocks, chained hashes, the last token never from the cache), and the server NVIDIA Dynamo's KV "
               "router cost would pick: overlap_score_weight (1) x prefill blocks + decode blocks (active blocks "
               "from the server's /metrics, plus the request's own), lowest wins. engine.watch.router.")


def router_panel(servers, mirrors: dict, values: dict, key: str, unavailable: dict | None = None) -> dict:
    """Paste a prompt (text, tokenized with the sidebar's tokenizer as vLLM's /v1/completions does, or token
    ids): its cached prefix per server and where a KV-aware router would send it (``engine.watch.router``).
    Returns stream -> the matched hashes, which the trees ring."""
    prompt_key = f"{key}_router_prompt"
    with st.expander("Router view: how much of a prompt is cached on each server, and where a KV-aware router "
                     "would send it", expanded=bool(st.session_state.get(prompt_key, "").strip())):
        c = st.columns([5, 1.2], vertical_alignment="top")
        text = c[0].text_area("Prompt", key=prompt_key, height=80, help=ROUTER_HELP,
                              placeholder="paste a prompt's text, or its token ids (e.g. 1, 2, 3)")
        kind = c[1].radio("The prompt is", ["text", "token ids"], key=f"{key}_router_kind")
        if not text.strip():
            st.caption("Paste a prompt to see its cached prefix on each server, ringed in green in the trees.")
            return {}
        try:
            ids = parse_ids(text) if kind == "token ids" else tokenize(text)
            result = route(servers, mirrors, ids, values, unavailable=unavailable, model_limit=prompt_limit(kind))
        except ValueError as exc:
            st.error(f"Router view: {exc}")
            return {}
        rows = ["| server | cached prefix (tokens) | blocks | prefill blocks | decode blocks | cost |",
                "| --- | ---: | ---: | ---: | ---: | ---: |"]
        notes = []
        for name, r in result["servers"].items():
            if not r["candidate"]:
                rows.append(f"| {name} | {r['why_not']} | - | - | - | - |")
                continue
            if r.get("incomplete"):
                notes.append(f"{name}: {r['incomplete']}: its cached prefix may be larger than shown.")
            load = "" if r["load_known"] else " (load unknown)"
            rows.append(f"| {'**' + name + '**' if name == result['choice'] else name} | "
                        f"{r['cached_prefix_tokens']:,} of {r['prompt_tokens']:,} | {r['cached_prefix_blocks']:,} | "
                        f"{r['prefill_blocks']:g} | {r['decode_blocks']:g}{load} | {r['cost']:g} |")
        st.markdown("\n".join(rows))
        st.caption(f"Costs in blocks of {result['cost_block_size']} tokens for every server (one unit when "
                   f"block sizes differ).")
        for n in notes:
            st.caption(n)
        if result["choice"] is None:
            st.warning("No server is a candidate (each row says why).")
        else:
            st.markdown(f"A KV-aware router would send it to **{result['choice']}**.", help=ROUTER_HELP)
        return {result["_streams"][n]: result["_hashes"][n] for n in result["_streams"]}


def tokenize(text: str) -> list[int]:
    """Text -> ids with the sidebar's tokenizer (special tokens added, as vLLM's /v1/completions does)."""
    folder = st.session_state.get("server_tokenizer", EMBEDDED_MODEL).strip()
    if not folder or not Path(folder).is_dir():
        raise ValueError(f"a text prompt needs the server's tokenizer: the sidebar's folder {folder!r} is not one "
                         f"(or paste token ids)")
    return check_prompt(load_tokenizer(folder)(text, verbose=False)["input_ids"])


def prompt_limit(kind: str) -> tuple[int, str] | None:
    """The sidebar tokenizer's model limit (``router.model_limit``) for a text prompt, or None."""
    folder = st.session_state.get("server_tokenizer", EMBEDDED_MODEL).strip()
    if kind == "token ids" or not folder or not Path(folder).is_dir():
        return None
    from engine.watch.router import model_limit

    return model_limit(load_tokenizer(folder), folder)


# ---------------------------------------------------------------------------------------------- replay
def shipped_captures() -> list[str]:
    return sorted(p.name for p in CAPTURES.glob("*.jsonl")) if CAPTURES.is_dir() else []


def load_replay(key: str, name: str, source) -> None:
    """Read a capture (a path or an upload's bytes) into the session; on a bad file keep what was loaded and
    say why."""
    try:
        capture = read_capture(source)
    except ValueError as exc:
        st.session_state["replay_error"] = (key, f"{name}: {exc}")
        return
    except OSError as exc:
        st.session_state["replay_error"] = (key, f"{name}: cannot be read ({exc})")
        return
    st.session_state["replay"] = {"key": key, "name": name, "replay": CaptureReplay(capture)}
    st.session_state["replay_pos"] = 0
    st.session_state["replay_playing"] = False
    st.session_state.pop("replay_error", None)


def replay_sidebar() -> None:
    sb = st.sidebar
    sb.subheader("Capture")
    shipped = shipped_captures()
    choice = sb.selectbox("Shipped capture", ["(none)"] + shipped, index=1 if shipped else 0,
                          key="replay_shipped", help=f"JSON-lines captures in {CAPTURES.relative_to(ROOT)}/")
    upload = sb.file_uploader("Or upload a capture", key="replay_upload",
                              help="A file written by this page's Download capture or `python -m engine watch "
                                   "--record`")
    if upload is not None and st.session_state.get("replay_upload_seen") != upload.file_id:
        st.session_state["replay_upload_seen"] = upload.file_id
        load_replay(f"upload:{upload.file_id}", upload.name, upload.getvalue())
    elif choice != "(none)" and st.session_state.get("replay_shipped_seen") != choice:
        st.session_state["replay_shipped_seen"] = choice
        load_replay(f"shipped:{choice}", choice, CAPTURES / choice)
    error = st.session_state.get("replay_error")
    if error and error[0].startswith("upload:") and (upload is None or error[0] != f"upload:{upload.file_id}"):
        st.session_state.pop("replay_error")  # the bad file was taken out of the uploader


def replay_mode() -> None:
    if err := st.session_state.get("replay_error"):
        st.error(f"Capture not loaded: {err[1]}")
    rep = st.session_state.get("replay")
    if rep is None:
        st.info("Choose a capture in the sidebar: a shipped one from assets/captures/ or your own upload (a file "
                "from this page's **Download capture** or `python -m engine watch ... --record FILE`).")
        return
    replay: CaptureReplay = rep["replay"]
    header = replay.capture.header
    total = len(replay)
    ranks = replay.capture.ranks
    servers = servers_of_capture(header, ranks)
    whose = (f"servers {', '.join(sv.name for sv in servers)}" if header.get("servers") else
             f"rank{'s' * (len(ranks) != 1)} {', '.join(map(str, ranks)) or '-'}")
    st.caption(f"**{rep['name']}**: {plural(total, 'batch', 'batches')} from {whose}, recorded {str(header.get('created', '?'))[:10]} from "
               f"{_clip(str(header.get('source') or '?'), 48)}",
               help=f"source: {header.get('source')}; model: {header.get('model')}; endpoints: "
                    f"{', '.join(header.get('endpoints') or []) or '-'}; block size {header.get('block_size')}; "
                    f"num_gpu_blocks {header.get('num_gpu_blocks')}" + "".join(f"; {n}" for n in header.get("notes") or []))
    if total == 0:
        st.info("This capture holds no batch.")
        return
    playing = st.session_state.get("replay_playing", False)
    speed = st.session_state.get("replay_speed", 2)
    tick = max(1.0 / speed, 0.25)
    # Step / Back / scrub re-run only this fragment (quick); Play re-runs it on a timer
    st.fragment(run_every=tick if playing else None)(replay_view)(rep, speed)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _played_position(pos: int, speed: float) -> int:
    """Where Play is now: the batch reached at ``speed`` batches per second since Play started (or since
    the last Step, Back, scrub or speed change), at least one past ``pos``. Timed from the clock, not by
    counting ticks, so a page that renders slower than the timer still plays at the speed shown (it shows
    fewer of the intermediate batches)."""
    now = time.monotonic()
    anchor = st.session_state.get("replay_anchor")
    if anchor is None or anchor[2] != speed:
        st.session_state["replay_anchor"] = (now, pos, speed)
        return pos + 1
    t0, pos0, _ = anchor
    return max(pos + 1, pos0 + int((now - t0) * speed))


def _move(delta: int) -> None:
    st.session_state.pop("replay_anchor", None)
    total = len(st.session_state["replay"]["replay"])
    st.session_state["replay_pos"] = max(0, min(total, st.session_state.get("replay_pos", 0) + delta))


def _scrubbed() -> None:
    st.session_state.pop("replay_anchor", None)
    st.session_state["replay_pos"] = st.session_state["replay_scrub"]


def replay_controls(total: int, armed_speed: float) -> None:
    """Back / Step / Play and the speed, and the scrub slider, in one row."""
    pos = st.session_state.get("replay_pos", 0)
    c = st.columns([1.5, 1.6, 1.1, 1.3, 3.4], vertical_alignment="bottom")
    c[0].button("Back", on_click=_move, args=(-1,), shortcut="PageUp", width="stretch", disabled=pos <= 0,
                help="The cache one batch earlier (PageUp). Rebuilt from the capture, nothing re-runs.")
    c[1].button("Step", on_click=_move, args=(1,), type="primary", shortcut="PageDown", width="stretch",
                disabled=pos >= total, help="Apply the next batch (PageDown, or a presenter's clicker)")
    playing = st.session_state.get("replay_playing", False)
    if c[2].button("Pause" if playing else "Play", shortcut="P", width="stretch",
                   help="Apply batches on a timer at the chosen speed (P)"):
        st.session_state.pop("replay_anchor", None)
        if not playing and pos >= total:
            st.session_state["replay_pos"] = 0  # Play at the end starts again
        st.session_state["replay_playing"] = not playing
        st.rerun()  # the whole page: the timer is set where the fragment is made
    speed = c[3].select_slider("Batches / s", SPEEDS, value=2, key="replay_speed",
                               help="Play's speed, in batches per second")
    if playing and speed != armed_speed:
        st.rerun()
    st.session_state["replay_scrub"] = min(pos, total)  # set before the slider exists in this run
    c[4].slider("Batch", 0, total, key="replay_scrub", on_change=_scrubbed,
                help="Time travel over the capture: the cache after this many batches (0: before the first)")


def replay_view(rep: dict, armed_speed: float) -> None:
    """The controls and the cache after the first ``replay_pos`` batches (re-run on a timer while playing)."""
    replay: CaptureReplay = rep["replay"]
    total = len(replay)
    if st.session_state.get("replay_playing"):
        pos = st.session_state.get("replay_pos", 0)
        if pos >= total:
            st.session_state["replay_playing"] = False
            st.session_state.pop("replay_anchor", None)
            st.rerun()  # the whole page, so the button says Play again
        st.session_state["replay_pos"] = min(total, _played_position(pos, armed_speed))
        if st.session_state["replay_pos"] >= total:  # the last batch: stop on this tick, not the next
            st.session_state["replay_playing"] = False
            st.session_state.pop("replay_anchor", None)
            st.rerun()  # the whole page, so the timer stops and the button says Play again
    replay_controls(total, armed_speed)
    pos = min(st.session_state.get("replay_pos", 0), total)
    state = replay.state(pos)
    if pos == 0:
        st.markdown(f"**batch 0 of {total:,}**: before the first batch; press **Step** (or PageDown)")
    else:
        b = replay.capture.batches[pos - 1]
        mirror = state.mirrors[b.rank]
        servers_now = servers_of_capture(replay.capture.header, replay.capture.ranks)
        owner = next((sv for sv in servers_now if b.rank in sv.streams), None)
        said = (batch_line(owner.label(b.rank, len(servers_now) == 1) if owner else b.rank, mirror.history[-1],
                           pos, total)
                if mirror.history and mirror.history[-1].seq == b.seq else
                f"batch {pos:,} of {total:,}: rank {b.rank}, #{b.seq} could not be applied (see below)")
        st.markdown(f"{said} · {b.t:.2f} s into the capture")
    for e in state.errors[-3:]:
        st.warning(e)
    servers = servers_of_capture(replay.capture.header, replay.capture.ranks)
    single = len(servers) == 1
    named = not (single and servers[0].name == "server")
    decode = decoder_cached()
    tiles = [(sv, r) for sv in servers for r in sv.streams if r in state.mirrors]
    metrics_now = {sv.name: capture_metrics(replay, pos, sv.name) for sv in servers}
    routed = router_panel(servers, state.mirrors, {k: v for k, v in metrics_now.items() if v is not None}, "replay")
    for col, (sv, r) in zip(tile_columns(len(tiles)), tiles):
        mirror = state.mirrors[r]
        values = metrics_now[sv.name]
        with col:
            if named and r == sv.streams[0]:
                st.markdown(f"#### {sv.name}")
                if values is not None:
                    server_row(values, None, "the capture's last scrape at this point", narrow=len(tiles) > 1,
                               scrapes=capture_scrapes(replay, pos, sv.name))
            name = sv.label(r, single)
            if not (named and len(sv.streams) == 1):  # a one-rank server is named by its heading
                st.markdown(f"**{name}**")
            rank_panel(mirror, decode, capture_pool(replay, sv.name, values), f"replay{r}", wide=len(tiles) == 1,
                       label=name, highlight=routed.get(r), scrapes=capture_epoch_scrapes(replay, pos, sv.name))
    if not named and metrics_now[servers[0].name] is not None:
        server_row(metrics_now[servers[0].name], None, "the capture's last scrape at this point",
                   scrapes=capture_scrapes(replay, pos, servers[0].name))


def capture_epoch_scrapes(replay: CaptureReplay, pos: int, name: str) -> list:
    """Server ``name``'s scrapes up to ``pos`` as (seconds since the epoch, values): a line's ``at``, or, in a
    capture written before it, its receive time ``t`` moved onto the server's clock by the first batch's
    ``ts`` - ``t``."""
    if pos == 0:
        return []
    first = replay.capture.batches[0]
    first_ts = server_time(first)
    offset = (first_ts - first.t) if first_ts is not None else 0.0
    t = replay.capture.batches[pos - 1].t
    return [(m.get("at", m.get("t", 0.0) + offset), m["values"]) for m in server_scrapes(replay.capture, name)
            if m.get("t", 0) <= t]


def capture_pool(replay: CaptureReplay, name: str, values: dict | None) -> int | None:
    """Server ``name``'s pool: the capture's header (its entry) or its /metrics at this point."""
    return server_pool(replay.capture, name) or (values or {}).get("num_gpu_blocks")


def capture_scrapes(replay: CaptureReplay, pos: int, name: str | None = None) -> list:
    """(time, values) of server ``name``'s scrapes up to the batch at ``pos`` (capture time, seconds)."""
    if pos == 0:
        return []
    t = replay.capture.batches[pos - 1].t
    return [(m.get("t", 0.0), m["values"]) for m in server_scrapes(replay.capture, name) if m.get("t", 0) <= t]


def capture_metrics(replay: CaptureReplay, pos: int, name: str | None = None) -> dict | None:
    """Server ``name``'s last /metrics scrape in the capture at or before the batch at ``pos``."""
    scrapes = capture_scrapes(replay, pos, name)
    return scrapes[-1][1] if scrapes else None


# ---------------------------------------------------------------------------------------------- page
def common_sidebar() -> None:
    sb = st.sidebar
    sb.text_input("Tokenizer (model folder)", EMBEDDED_MODEL, key="server_tokenizer",
                  help="Decodes each block's token ids for the hover. Use the server's own model folder: another "
                       "model's tokenizer turns the ids into the wrong text. Empty: ids only.")
    sb.radio("Colour blocks by", list(COLOR_BY), format_func=COLOR_BY.get, key="server_color_by")
    st.session_state["server_decode"] = decoder()


def decoder_cached():
    """The decoder chosen in this run's sidebar (the fragment re-runs without the sidebar)."""
    return st.session_state.get("server_decode")


def intro(showing: bool) -> None:
    """The explanation; folded away while a cache is on screen, so the figures fit a projector's 720 px."""
    def how_to() -> None:
        st.code(VLLM_COMMAND, language="bash")
        st.caption("One endpoint per data-parallel rank: rank r publishes on the endpoint's port + r. The replay "
                   "endpoint lets this page ask for batches it missed. The API server serves /metrics on its own "
                   "port (e.g. http://127.0.0.1:8000/metrics).")

    if showing:
        with st.expander("About this page: KV cache events from a real server, and how to turn them on in vLLM"):
            st.markdown(INTRO)
            how_to()
    else:
        st.markdown(INTRO)
        with st.expander("Start vLLM with KV events on"):
            how_to()


def main() -> None:
    sweep()
    mode = st.session_state.get("server_mode", MODES[0])  # the radio below; its value is known before it is drawn
    # the sidebar first: a new upload takes effect before the page is drawn
    if mode != MODES[0]:
        replay_sidebar()
    common_sidebar()
    st.title("Server")
    intro(st.session_state.get("server_live" if mode == MODES[0] else "replay") is not None)
    st.radio("Mode", MODES, horizontal=True, key="server_mode", label_visibility="collapsed")
    if mode == MODES[0]:
        live_controls()
        live_mode()
    else:
        replay_mode()


main()

"""Exports of a recorded run (viz/export.py): the interactive HTML file holds one Plotly frame per step with that
step's pool, baseline and sentences, loads nothing from the network, and animates safely (Plotly's
``animate`` merges frames); GIF / MP4 / PNG through kaleido + Chromium (skipped, with the reason, where
kaleido cannot start a browser)."""

from __future__ import annotations

import html
import re

import pytest

from engine import EMBEDDED_MODEL
from engine.metrics import slots_allocated, slots_used
from engine.model_loader import load_shared
from ui.lab import Lab
from ui.state import preset_settings
from viz import export
from viz.steps import step_sentences


def recorded_run(preset: str, max_steps: int = 400) -> tuple[list, list[str]]:
    lab = Lab.create(preset_settings(preset), load_shared(EMBEDDED_MODEL))
    while lab.has_work() and lab.step_count < max_steps:
        lab.step()
    return lab.run.history, lab.run.order


@pytest.fixture(scope="module")
def parallel():
    """The parallel-sampling preset run to the end (32 steps: prefill, forks, copy-on-write, decode)."""
    return recorded_run("parallel-sampling")


@pytest.fixture(scope="module")
def shared_prefix():
    """The shared-prefix preset's first 12 steps (the contiguous baseline admits and queues requests)."""
    return recorded_run("shared-prefix", 12)


def flat(text: str) -> str:
    """Annotation text as it reads: markup and line breaks out, entities decoded, whitespace closed up."""
    return re.sub(r"\s+", "", html.unescape(re.sub(r"<[^>]+>", "", text)))


def annotation(frame: dict, name: str) -> dict:
    return next(a for a in frame["layout"]["annotations"] if a.get("name") == name)


def test_one_frame_per_step_with_its_pool_and_sentences(parallel):
    history, order = parallel
    fig = export.run_figure(history, order)
    frames = fig["frames"]
    assert [f["name"] for f in frames] == [str(p.step) for p, _ in history]
    for frame, (paged, contiguous) in zip(frames, history):
        snap = paged.snapshot
        pool = frame["data"][0]
        assert pool["type"] == "heatmap" and pool["xaxis"] == "x"
        cells = [c for row in pool["customdata"] for c in row if c[0] is not None]
        assert [c[0] for c in cells] == list(range(snap.num_blocks))
        assert [c[2] for c in cells] == snap.ref_counts  # each cell's reference count is this step's
        assert sum(c[2] > 0 for c in cells) == snap.num_used_blocks
        title = annotation(frame, "title: paged block pool")["text"]
        assert f"{snap.num_used_blocks}/{snap.num_blocks} blocks in use" in title
        said = flat(annotation(frame, "sentences")["text"])
        for sentence in step_sentences(paged, contiguous):
            assert flat(sentence) in said
        assert f"step {paged.step} of {history[-1][0].step}" in frame["layout"]["title"]["text"]
    # the figure opens on the first step, and the slider names every step
    assert fig["data"] == frames[0]["data"]
    assert [s["label"] for s in fig["layout"]["sliders"][0]["steps"]] == [f["name"] for f in frames]


def test_contiguous_strip_is_each_steps_baseline(shared_prefix):
    history, order = shared_prefix
    fig = export.run_figure(history, order)
    assert len(fig["frames"]) == len(history) == 12
    for frame, (_, contiguous) in zip(fig["frames"], history):
        snap = contiguous.snapshot
        title = annotation(frame, "title: contiguous baseline")["text"]
        assert f"{slots_used(snap):,} used / {slots_allocated(snap):,} reserved" in title
        said = flat(annotation(frame, "sentences")["text"])
        for sentence in step_sentences(history[int(frame["name"]) - 1][0], contiguous):
            assert flat(sentence) in said
    # the baseline's own decisions are said too ("contiguous: R5 waits at the door ...")
    assert any("contiguous:" in annotation(f, "sentences")["text"] for f in fig["frames"])


def test_frames_are_safe_to_animate(shared_prefix):
    """Plotly's animate merges each frame into what is drawn: every frame must set the same traces, shapes,
    annotations and attributes (a missing one would keep the previous step's outline or fill on screen)."""
    history, order = shared_prefix
    frames = export.run_figure(history, order)["frames"]

    def keys(value):
        if isinstance(value, dict):
            return {k: keys(v) for k, v in value.items() if k not in ("range",)}
        if isinstance(value, list) and value and all(isinstance(x, dict) for x in value):
            return [keys(x) for x in value]
        return None

    first = frames[0]
    assert len({len(f["layout"]["shapes"]) for f in frames}) == 1
    assert len({len(f["layout"]["annotations"]) for f in frames}) == 1
    for f in frames[1:]:
        assert [t["type"] for t in f["data"]] == [t["type"] for t in first["data"]]
        assert keys(f["data"]) == keys(first["data"])
        assert keys(f["layout"]) == keys(first["layout"])
    # the pool's outlines come and go with the steps, but never outlive their step
    outlined = [sum(s["visible"] for s in f["layout"]["shapes"] if s.get("xref") == "x") for f in frames]
    assert len(set(outlined)) > 1


def test_html_is_one_self_contained_file(parallel):
    history, order = parallel
    page = export.run_html(history, order, title="parallel sampling <n=4>")
    assert page.startswith("<!doctype html>") and "<title>parallel sampling &lt;n=4&gt;</title>" in page
    assert export.external_loads(page) == []
    assert "<script src=" not in page and "<link" not in page
    assert "Plotly.addFrames" in page and len(page) > 4_000_000  # plotly.js itself is inside
    # each frame's sentences, and the first step's again in the figure drawn on opening
    assert len(re.findall(r'"name":\s*"sentences"', page)) == len(history) + 1
    last = history[-1][0].step
    assert f"step {last} of {last}" in page
    assert len(page) < 12_000_000, f"{len(page):,} bytes for {len(history)} steps"


def test_external_loads_finds_what_a_page_would_fetch():
    page = ('<html><head><script src="https://cdn.plot.ly/plotly.js"></script>'
            '<link rel="stylesheet" href="http://x/y.css"></head><body><a href="https://ok">x</a>'
            '<script>var s = "<img src=https://not-a-tag>";</script><img src="data:image/png;base64,AA">'
            '<style>@import url("https://fonts/x.css");</style></body></html>')
    assert export.external_loads(page) == ["<script src=https://cdn.plot.ly/plotly.js>",
                                           "<link href=http://x/y.css>",
                                           '<style>@import url("https://fonts/x.css");</style>']
    assert export.external_loads("<html><style>.a {color: red}</style></html>") == []


def test_long_runs_are_sampled_and_bad_input_named(parallel):
    history, order = parallel
    assert export.sample_steps(1000, 400)[:2] == [0, 3] and export.sample_steps(1000, 400)[-1] == 999
    assert len(export.sample_steps(1000, 400)) == 400
    assert export.sample_steps(5, 400) == [0, 1, 2, 3, 4]
    fig = export.run_figure(history, order, max_steps=5)
    assert [f["name"] for f in fig["frames"]] == ["1", "9", "17", "24", "32"]
    assert "5 of 32 steps shown" in fig["layout"]["title"]["text"]
    with pytest.raises(ValueError, match="no recorded steps"):
        export.run_html([], order)
    with pytest.raises(ValueError, match="max_steps 1"):
        export.run_figure(history, order, max_steps=1)
    with pytest.raises(IndexError, match="step index 32"):
        export.step_figure(history, 32, order)
    with pytest.raises(ValueError, match="fps 0"):
        export.run_gif(history, order, fps=0)


# ------------------------------------------------------------------------------------- images (kaleido)
@pytest.fixture(scope="module")
def kaleido_ok():
    """Skip the image tests where kaleido cannot render (no kaleido, no Chromium, or a browser that fails to
    start), naming why."""
    try:
        png = export.figure_png({"data": [{"type": "bar", "y": [1, 2]}], "layout": {"width": 64, "height": 48}}, 1)
    except export.ExportError as exc:
        pytest.skip(f"kaleido cannot render here: {exc}")
    assert png.startswith(b"\x89PNG")


def test_gif_has_one_frame_per_step(parallel, kaleido_ok):
    import imageio.v3 as iio

    history, order = parallel
    done = []
    gif = export.run_gif(history[:4], order, fps=2, on_frame=lambda i, n: done.append((i, n)))
    frames = iio.imread(gif, index=None, extension=".gif")
    assert frames.shape[0] == 4 and frames.shape[2] == export.IMAGE_WIDTH
    assert done == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert iio.immeta(gif, extension=".gif", index=0)["duration"] == 500
    assert not (frames[0] == frames[1]).all()  # the steps differ on screen


def test_mp4_and_png(parallel, kaleido_ok):
    import imageio.v3 as iio

    history, order = parallel
    mp4 = export.run_mp4(history[:3], order, fps=1)
    assert mp4[4:8] == b"ftyp"
    png = export.figure_png(export.step_figure(history, 5, order))
    image = iio.imread(png)
    assert image.shape[1] == 2 * export.IMAGE_WIDTH  # scale 2 for slides


# ------------------------------------------------------------------------------------- the Playground's panel
def test_playground_export_panel_builds_on_click_only(kaleido_ok):
    """The Export expander under the Playground: nothing is built on a plain script run; "Build GIF" builds
    one GIF of the steps recorded (kept per lab and steps), and the HTML download's deferred builder gives
    the run's page."""
    import imageio.v3 as iio
    from streamlit.testing.v1 import AppTest

    from ui.exports import CACHE_KEY, OPEN_KEY, html_builder

    at = AppTest.from_file(str(__import__("pathlib").Path(__file__).resolve().parent.parent / "app.py"),
                           default_timeout=240)
    at.run()
    for _ in range(2):
        next(b for b in at.button if b.label == "Step").click().run()
    assert not at.exception
    assert any(e.label.startswith("Export") for e in at.expander)
    assert at.session_state[CACHE_KEY] == {}  # drawing the page built nothing
    assert not any(b.label.startswith("Build") for b in at.button)  # closed: its widgets are not even drawn
    at.session_state[OPEN_KEY] = True  # the expander opened (its state reruns the page)
    at.run()
    next(b for b in at.button if b.label.startswith("Build GIF")).click().run()
    assert not at.exception
    lab = at.session_state["lab"]
    built = at.session_state[CACHE_KEY]
    assert not at.error, [e.value for e in at.error]
    (key, gif), = built.items()
    assert key[:3] == (lab.protocol.token, 2, "GIF")
    assert iio.imread(gif, index=None, extension=".gif").shape[0] == 2
    page = html_builder(lab, lab.run.history, {})()
    assert page.count("Plotly.addFrames") == 1 and export.external_loads(page) == []

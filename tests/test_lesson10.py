"""Lesson 10, hybrid models (issue 25 item 5): the real configs' arithmetic against a computation written
here from the raw JSON (not through kv_math or the engine), every exercise's answer against the engine's
own run (the recorded tables and events, the engine's cached-token counts), and the page in AppTest."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from engine.metrics import hybrid_blocks_saved
from engine.single_type_kv_cache_manager import NULL_BLOCK
from lessons import kv_math
from lessons.common import LessonContext

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "lessons" / "data" / "models"
B = 16


@pytest.fixture(scope="module")
def l10():
    import lessons.l10_hybrid_models as mod

    return mod


@pytest.fixture(scope="module")
def ctx():
    return LessonContext()  # the lesson runs its own model (the tiny hybrid); nothing of the embedded one


@pytest.fixture(scope="module")
def exs(l10, ctx):
    return l10.exercises(ctx)


@pytest.fixture(scope="module")
def run(l10):
    return l10.window_run()


@pytest.fixture(scope="module")
def prefix(l10):
    return l10.prefix_run()


# ------------------------------------------------------------------- the real configs, computed by hand
def raw(name: str) -> dict:
    d = json.loads((MODELS / f"{name}.json").read_text())
    assert d["source"] == {"gpt-oss-20b": "https://huggingface.co/openai/gpt-oss-20b/blob/main/config.json",
                           "gemma-3-12b": "https://huggingface.co/google/gemma-3-12b-it/blob/main/config.json"}[name]
    return d["config"]


def hand_groups(c: dict) -> list[tuple[int | None, int]]:
    """(window or None, layers) per KV cache group, by vLLM's rule written out for these two models: the
    group size is the fewer layers of a kind when the other kind has 1.5 times as many or more."""
    n = c["num_hidden_layers"]
    if "layer_types" in c:
        sliding = sum(t == "sliding_attention" for t in c["layer_types"])
    else:  # Gemma 3: every sliding_window_pattern-th layer is global
        sliding = n - n // c["sliding_window_pattern"]
    full = n - sliding
    size = max(sliding, full) if max(sliding, full) < 1.5 * min(sliding, full) else min(sliding, full)
    return [(c["sliding_window"], size)] * (sliding // size) + [(None, size)] * (full // size)


def hand_fit(c: dict, weights: int, L: int) -> tuple[int, int]:
    """(hybrid requests, twin requests) of L tokens on 80 x 10^9 bytes x 0.9 - weights, blocks of 16."""
    per_layer = 2 * c["num_key_value_heads"] * c["head_dim"] * 2  # bfloat16
    groups = hand_groups(c)
    page = B * per_layer * groups[0][1]
    blocks = (int(80e9 * 0.9) - weights) // page
    n = math.ceil(L / B)
    held = sum(n if w is None else n - (L - w + 1) // B for w, _ in groups)
    return blocks // held, blocks // (len(groups) * n)


def test_the_real_configs_have_the_fields_the_arithmetic_needs():
    gpt, gemma = raw("gpt-oss-20b"), raw("gemma-3-12b")
    assert (gpt["num_hidden_layers"], gpt["num_key_value_heads"], gpt["head_dim"], gpt["sliding_window"]) == (24, 8, 64, 128)
    assert gpt["layer_types"] == ["sliding_attention", "full_attention"] * 12 and gpt["torch_dtype"] == "bfloat16"
    assert (gemma["num_hidden_layers"], gemma["num_key_value_heads"], gemma["head_dim"], gemma["sliding_window"],
            gemma["sliding_window_pattern"]) == (48, 8, 256, 1024, 6)
    # the engine reads the same pattern from the built config: every sixth layer full
    from engine.kv_cache import layer_windows

    windows = layer_windows(kv_math.model_presets(include_hybrid=True)["gemma-3-12b"].config)
    assert [i for i, w in enumerate(windows) if w is None] == [5, 11, 17, 23, 29, 35, 41, 47]


def test_bytes_per_token_per_group_match_a_hand_computation():
    for name in ("gpt-oss-20b", "gemma-3-12b"):
        c = raw(name)
        p = kv_math.model_presets(include_hybrid=True)[name]
        got = [(g.sliding_window, len(g.layers), g.bytes_per_token) for g in kv_math.group_costs(p.config, p.dtype)]
        want = [(w, n, 2 * n * c["num_key_value_heads"] * c["head_dim"] * 2) for w, n in hand_groups(c)]
        assert got == want, name
    assert [g[2] for g in got] == [65_536] * 6  # Gemma 3 12B: 6 groups of 8 layers, 64 KiB a token each


def test_gpt_oss_weights_are_the_model_cards_checkpoint_size():
    p = kv_math.model_presets(include_hybrid=True)["gpt-oss-20b"]
    c = raw("gpt-oss-20b")
    experts = c["num_hidden_layers"] * c["num_local_experts"] * c["hidden_size"] * (2 * c["intermediate_size"]
                                                                                      + c["intermediate_size"])
    total = kv_math.parameter_count(p)
    assert round(total / 1e9) == 21  # "21B parameters" (model card)
    assert kv_math.weight_bytes(p) == (total - experts) * 2 + math.ceil(experts * 4.25 / 8)
    assert round(kv_math.weight_bytes(p) / 2**30, 1) == 12.8  # the model card's checkpoint size, 12.8 GiB


@pytest.mark.parametrize("name", ["gpt-oss-20b", "gemma-3-12b"])
@pytest.mark.parametrize("L", [8192, 32768, 131072])
def test_requests_that_fit_match_a_hand_computation_and_lesson_1s_convention(l10, name, L):
    p = kv_math.model_presets(include_hybrid=True)[name]
    weights = kv_math.weight_bytes(p)
    fit = l10.fits(name)[L]
    assert (fit.requests, fit.twin_requests) == hand_fit(raw(name), weights, L)
    # the twin is lesson 1's gpu_fit with every layer's bytes per token, at whole blocks
    whole = kv_math.gpu_fit(80 * 10**9, weights, kv_math.bytes_per_token(p.config, p.dtype), math.ceil(L / B) * B)
    assert fit.twin_requests == whole.requests
    row = next(r for r in l10.fit_rows(name) if r["tokens per request"] == f"{L:,}")
    assert (row["requests that fit (hybrid)"], row["requests that fit (twin)"]) == (fit.requests, fit.twin_requests)


def test_lessons_1_to_9_list_only_all_full_attention_configs():
    assert set(kv_math.model_presets()) == {"llama-2-7b", "llama-3-8b", "qwen2.5-7b", "smollm2-135m"}
    assert {"gpt-oss-20b", "gemma-3-12b"} <= set(kv_math.model_presets(include_hybrid=True))


# --------------------------------------------------------------------- the answers come from the engine
def test_p_saved_is_the_twin_minus_what_the_recorded_tables_hold(l10, exs, run):
    v = run.steps[-1]
    held = sum(b != NULL_BLOCK for t in v.tables for b in t)  # counted from the tables, not the metric
    twin = len(v.tables) * -(-v.num_tokens // B)
    assert exs["p_saved"].expected == twin - held == hybrid_blocks_saved(v.computed_before, B, run.windows) > 0
    assert f"computed **{v.computed_before} tokens**" in exs["p_saved"].question
    # at every step the metric is what the tables say
    for s in run.steps:
        assert len(s.tables) * -(-s.num_tokens // B) - s.held == run.saved(s), s.step
        # and it is the figure the Playground and the CLI show (engine.metrics.hybrid_saving of the record)
        assert (s.saving["blocks"], s.saving["held"], s.saving["twin"]) == (run.saved(s), s.held, run.twin(s))


def test_a_free_is_what_the_sliding_group_gave_back_at_that_step(exs, run):
    g = next(i for i, w in enumerate(run.windows) if w is not None)
    W = run.windows[g]
    i = next(k for k, s in enumerate(run.steps) if len(s.left_window.get(g, [])) > 1)
    prev, at = run.steps[i - 1], run.steps[i]
    gone = (at.computed_before - W + 1) // B  # blocks wholly before the window of the next token
    expected = [b for b in prev.tables[g][:gone] if b != NULL_BLOCK]
    assert sorted(exs["a_free"].expected) == sorted(expected) == sorted(at.left_window[g])
    assert len(expected) > 1 and all(b == NULL_BLOCK for b in at.tables[g][:gone])
    full = next(k for k, w in enumerate(run.windows) if w is None)
    assert NULL_BLOCK not in at.tables[full]  # the full group gave nothing back


def test_a_hit_and_t_again_are_the_engines_cached_tokens(exs, prefix):
    b, c = prefix.lookups["B"], prefix.lookups["C"]
    full = next(k for k, w in enumerate(prefix.windows) if w is None)
    sliding = 1 - full
    assert len(b.group_hits[full]) * B >= 96 and len(b.group_hits[sliding]) == 0  # only the full group had it
    assert exs["a_hit"].expected == b.cached_tokens == 0
    assert exs["t_again"].expected == c.cached_tokens == len(c.group_hits[sliding]) * B > 0
    assert all(x >= 6 for x in prefix.a_sliding_cached)  # A's sliding blocks lie past B's shared prefix


def test_the_real_config_answers(l10, exs):
    c = raw("gpt-oss-20b")
    assert exs["r_bytes"].expected == 2 * 12 * c["num_key_value_heads"] * c["head_dim"] * 2 / 1024
    p = kv_math.model_presets(include_hybrid=True)["gemma-3-12b"]
    assert exs["t_gemma"].expected == hand_fit(raw("gemma-3-12b"), kv_math.weight_bytes(p), 32768)[0]
    assert {s.name: s.answer for s in exs["t_gemma"].slips}["twin"] == hand_fit(
        raw("gemma-3-12b"), kv_math.weight_bytes(p), 32768)[1]


def test_the_lesson_names_vllms_source_for_each_rule(l10, ctx):
    facts = l10.facts(ctx)
    vllm = next(ROOT.glob(".peer-venv/lib/python3*/site-packages/vllm"), None)
    for fact, paths, functions in l10.VLLM_SOURCES:
        assert f"`{functions}`" in facts["sources"]
        if vllm is None:
            continue
        text = "".join((vllm.parent / p.strip()).read_text() for p in paths.split(","))
        for fn in functions.replace(";", ",").split(","):
            name = fn.strip().split(".")[-1]
            assert f"def {name}" in text or f"{name} =" in text or f"self.{name}" in text, (fn, paths)


# ---------------------------------------------------------------------------------------------- page
@pytest.mark.slow
def test_the_lesson_page_renders_and_runs_to_the_end(exs):
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=300)
    at.run()
    at.switch_page("lessons/l10_hybrid_models.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.title[0].value.startswith("Lesson 10: Hybrid models")
    assert len([b for b in at.button if b.label.startswith("Commit my answer")]) == 1
    at.session_state["lesson_progress"] = {f"l10_hybrid_models:{k}": {"raw": e.expected, "correct": True}
                                           for k, e in exs.items()}
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert len(at.success) == len(exs) and not at.error
    assert any(s.label == "Step" for s in at.slider)


# ------------------------------------------------------------------ the learner's findings (issue: lesson 10 trial)
def test_vllms_startup_figure_counts_two_batches_in_flight_under_async_scheduling(l10, ctx):
    """vllm serve on one GPU turns async scheduling on (VllmConfig.__post_init__), so max_concurrent_batches
    is 2 and SlidingWindowSpec.max_memory_usage_bytes budgets for 2 x max_num_batched_tokens in flight."""
    c = raw("gpt-oss-20b")
    weights = kv_math.weight_bytes(kv_math.model_presets(include_hybrid=True)["gpt-oss-20b"])
    page = B * 2 * 12 * c["num_key_value_heads"] * c["head_dim"] * 2
    blocks = (int(80e9 * 0.9) - weights) // page
    full = 32768 // B
    facts = l10.facts(ctx)
    for batches, blocks_key, conc_key in ((2, "adm_blocks", "adm_concurrency"),
                                          (1, "adm_sync_blocks", "adm_sync_concurrency")):
        sliding = math.ceil(min(c["sliding_window"] - 1 + batches * 8192, 32768) / B) + 1
        assert facts[blocks_key] == f"{sliding:,}"
        assert facts[conc_key] == f"{blocks / (full + sliding):.1f}"
    assert (facts["adm_blocks"], facts["adm_concurrency"]) == ("1,033", "48.1")  # the learner's own figures
    assert facts["adm_batches"] == 2 and facts["adm_in_flight"] == "16,384"
    text = (ROOT / "lessons" / "l10_hybrid_models.md").read_text()
    assert "async scheduling" in text and "--no-async-scheduling" in text
    vllm = next(ROOT.glob(".peer-venv/lib/python3*/site-packages/vllm"), None)
    if vllm is not None:  # the rule as vLLM writes it
        src = (vllm / "config" / "vllm.py").read_text()
        prop = src[src.index("def max_concurrent_batches"):src.index("def max_in_flight_tokens")]
        assert "if self.scheduler_config.async_scheduling:" in prop and "return 2" in prop
        assert "self.max_concurrent_batches * self.scheduler_config.max_num_batched_tokens" in src
        assert "self.scheduler_config.async_scheduling = True" in src  # the default when nothing objects


def _numbers(text: str) -> list[int]:
    import re

    return [int(x.replace(",", "")) for x in re.findall(r"[0-9][0-9,]*[0-9]", text)]


def test_the_weights_shown_reproduce_the_block_counts(l10, ctx, exs):
    facts = l10.facts(ctx)
    fit = l10.fits("gpt-oss-20b")[32768]
    budget, weights, page, blocks = _numbers(facts["worked_blocks_sum"])
    assert budget == int(80e9 * 0.9) and page == fit.page_bytes
    assert (budget - weights) // page == blocks == fit.num_blocks  # the arithmetic shown gives the count
    assert _numbers(facts["worked_weights"])[0] == weights  # the weights as the text gives them, in bytes
    gemma = l10.fits("gemma-3-12b")[32768]
    shown = next(n for n in _numbers(exs["t_gemma"].question) if n > 10**9)
    assert (int(80e9 * 0.9) - shown) // gemma.page_bytes == gemma.num_blocks


def test_the_intro_example_is_not_a_questions_answer(l10, ctx, exs, run):
    facts = l10.facts(ctx)
    assert facts["example_skip"] == (facts["example_c"] - run.windows[0 if run.windows[0] else 1] + 1) // B
    assert facts["example_c"] != run.steps[-1].computed_before
    text = (ROOT / "lessons" / "l10_hybrid_models.md").read_text()
    intro = text[:text.index("### What vLLM keeps")]
    assert "{{ skip_blocks }}" not in text and "{{ example_c }}" in intro
    assert intro.index("*W*") < intro.index("{{ window }}")  # the symbols before the tiny model's numbers


def test_the_null_block_note_says_vllm_reserves_block_0(l10):
    text = (ROOT / "lessons" / "l10_hybrid_models.md").read_text()
    note = text[text.index("**The null block.**"):text.index("To measure what the window saves")]
    assert "block 0" in note and "−1" in note and "one block more" in note


def test_a_free_refuses_a_block_id_outside_the_pool(exs, l10):
    ex = exs["a_free"]
    with pytest.raises(ValueError, match=r"99999999999999999999999 is not a block of this pool: its block ids "
                                         rf"run from 0 to {l10.NUM_BLOCKS - 1}"):
        ex.check("1, 99999999999999999999999")
    with pytest.raises(ValueError, match=rf"{l10.NUM_BLOCKS} is not a block of this pool"):
        ex.check(str(l10.NUM_BLOCKS))
    assert not ex.check(str(l10.NUM_BLOCKS - 1)).correct  # the last id is a block (a wrong one here)


def test_the_step_caption_names_tokens(l10):
    import inspect

    src = inspect.getsource(l10.widget_run)
    assert "tokens held after" in src


@pytest.mark.slow
def test_the_step_slider_keeps_each_value_and_shows_whole_tables(exs, l10, run, monkeypatch):
    """Setting the slider several times in a row: each value sticks, Streamlit logs no "default value but
    also set via the Session State API" warning, and both groups' tables are shown whole (Markdown)."""
    from streamlit.elements.lib import policies
    from streamlit.testing.v1 import AppTest

    warned = []
    monkeypatch.setattr(policies, "_shown_default_value_warning", False)
    monkeypatch.setattr(policies._LOGGER, "warning", lambda msg, *a, **k: warned.append(msg % a))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=300)
    at.run()
    at.switch_page("lessons/l10_hybrid_models.py").run()
    at.session_state["lesson_progress"] = {f"l10_hybrid_models:{k}": {"raw": e.expected, "correct": True}
                                           for k, e in exs.items()}
    at.run()
    for value in (4, 5, 6, 16, 17, 20, 25, 3):
        next(s for s in at.slider if s.label == "Step").set_value(value).run()
        assert not at.exception, [e.value for e in at.exception]
        assert next(s for s in at.slider if s.label == "Step").value == value
        v = run.steps[value - 1]
        shown = "\n".join(m.value for m in at.markdown)
        for table in v.tables:
            assert l10._table_text(table) in shown, (value, table)
        assert f"{v.num_tokens} tokens held after" in "\n".join(c.value for c in at.caption)
    assert not [w for w in warned if "default value" in w], warned

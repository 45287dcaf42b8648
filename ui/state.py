"""Streamlit glue: the shared read-only model (``infra.runs.shared_model``: loaded once per process, its
progress shown the first time), each session's ``Lab``, what "Apply and reset" builds (``applied_settings``:
a preset always means the same run) and the stage's press counter (``stage_keys``)."""

from __future__ import annotations

import dataclasses

import streamlit as st

from engine import EMBEDDED_MODEL
from engine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS_V1
from infra import runs

from . import class_server
from engine.scenarios.run_spec import RunSpec, count_only_tokenizer

from .lab import POLICY_LABELS, Lab


def shared_model(model: str):
    """(model, tokenizer), loaded once per process and shared read-only by every session and the lessons
    (``infra.runs.shared_model``: ``engine.model_loader.load_shared`` with a progress box on first load),
    one copy per real folder (every spelling of a path is one copy). On a class server a model it does not
    serve raises ValueError before anything is read (``infra.class_limits.check_model``)."""
    return runs.shared_model(model)


def get_lab() -> Lab | None:
    return st.session_state.get("lab")


def build_lab(settings: RunSpec) -> bool:
    """Replace the session's lab; on bad settings show the error and keep the previous lab."""
    try:
        loaded = shared_model(settings.model)
        class_server.check_sizes(settings, loaded)  # a class server: one session's share of memory, before allocating
        if Lab.needs_final_lengths(settings):  # a whole headless run first: seconds, so its progress is shown
            with runs.ProgressBox("Learning each request's final length first: the "
                                  f"{POLICY_LABELS.get(settings.contiguous_policy, settings.contiguous_policy)} "
                                  "policy reserves by it") as box:
                lab = Lab.create(settings, loaded, on_step=learning_progress(settings, box))
        else:
            lab = Lab.create(settings, loaded)  # builds two engines: well under a second
    except ValueError as exc:
        st.session_state["lab_error"] = str(exc)
        return False
    st.session_state["lab"] = lab
    class_server.seat_lab(lab)  # a class server releases it when this session idles (ui/class_server.py)
    st.session_state["lab_generation"] = st.session_state.get("lab_generation", 0) + 1  # a fresh settings form
    st.session_state["cursor"] = lab.player.cursor  # a mirror of the lab's own cursor (-1: follow the latest step)
    st.session_state["playing"] = lab.player.playing  # a mirror: a new run starts paused (Play on a preset nobody has
    # seen yet surprises)
    st.session_state.pop("lab_error", None)
    return True


def learning_progress(settings: RunSpec, box: runs.ProgressBox):
    """An ``on_step`` for ``Lab.create``'s headless paged run of the preset: its steps and tokens in ``box``."""
    from engine.scenarios.presets import get_scenario

    requests = get_scenario(settings.preset).make(settings.seed, count_only_tokenizer).requests
    total = sum(r.params.max_tokens * r.params.num_seqs for r in requests)
    state = {"step": 0, "tokens": 0}

    def on_step(record) -> None:
        state["step"] += 1
        state["tokens"] += len(record.new_tokens)
        box(runs.Progress(f"Running {settings.preset} on a paged engine (the paper's scheduler)",
                          state["tokens"] / total if total else 0.0,
                          runs.token_detail(state["step"], state["tokens"], total, known=False)))
    return on_step


def preset_settings(preset: str, model: str = EMBEDDED_MODEL, **overrides) -> RunSpec:
    """Settings for a preset: those of its shipped scenario file (``assets/scenarios/<preset>.json``: block
    size, pool, lengths, reservation, preemption, prefix caching, contiguous policy, watermark (None: the
    semantics' default), semantics, seed), then ``overrides`` (``RunSpec`` fields, e.g.
    ``semantics="v1"``). A scenario registered without a file takes its registry ``engine_defaults``
    (``engine.scenarios.scenario_file.registry_settings``, which also wrote the files).
    The one path from a preset to engine settings: the Playground, Compare, scenario links and the lessons'
    "Open this in the Playground" all use it. Raises ValueError for an unknown preset or field."""
    return RunSpec.from_preset(preset, model, **overrides)  # engine.scenarios.run_spec.RunSpec


def scenario_settings(scenario, model: str = EMBEDDED_MODEL) -> RunSpec:
    """Playground settings that run a scenario file (``engine.scenarios.scenario_file.ScenarioFile``): its preset's
    (``preset_settings``) when it is a shipped preset's file unchanged, so it is that preset again; else
    "custom" with the file's settings, semantics and seed, and its requests queued (``RunSpec.scenario``)."""
    from engine.scenarios import scenario_file
    from engine.scenarios.presets import SCENARIOS

    if scenario.name in SCENARIOS and scenario == scenario_file.load_preset(scenario.name):
        return preset_settings(scenario.name, model)
    return RunSpec.from_scenario(scenario, model)


def default_settings() -> RunSpec:
    """The "batch" preset with its own pool (12 blocks of 16): too small for all six requests, so the
    first minutes in class already show preemption."""
    return preset_settings("batch")


# ------------------------------------------------------------------------------------------ Apply and reset
# With "Use the preset's pool settings" ticked these come from the preset, whatever the form says.
POOL_FIELDS = ("block_size", "num_blocks", "max_model_len", "reservation", "kv_budget_mb", "swap_space_blocks")


def preset_fixed_fields(preset: str) -> set[str]:
    """The ``RunSpec`` fields a scenario fixes itself (its ``engine_defaults``, e.g. prefix caching off,
    preemption by swap, a watermark): with the tick they win over the form."""
    from engine.scenarios.presets import get_scenario

    names = {"reservation_tokens": "reservation"}
    fields = set(RunSpec.__dataclass_fields__)
    return {names.get(k, k) for k in get_scenario(preset).engine_defaults} & fields


def form_values(settings: RunSpec, semantics: str | None = None) -> dict:
    """What the Playground's settings form shows for ``settings`` when ``semantics`` is chosen above it (the
    form's own units: a watermark in %, 0 for "no swap pool" and "use blocks"): the values it opens with,
    so that ``applied_settings`` can tell what was changed from what was merely shown."""
    semantics = semantics or settings.semantics
    shown = dict(model=settings.model, block_size=settings.block_size, num_blocks=settings.num_blocks,
                 kv_budget_mb=float(settings.kv_budget_mb), max_model_len=settings.max_model_len,
                 reservation=settings.reservation or settings.max_model_len,
                 enable_prefix_caching=settings.enable_prefix_caching, seed=settings.seed,
                 contiguous_policy=settings.contiguous_policy,
                 watermark_pct=round(settings.effective_watermark * 100, 2), semantics=settings.semantics)
    if semantics == "v1":
        shown.update(scheduling_policy=settings.scheduling_policy,
                     max_num_batched_tokens=settings.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS_V1)
    else:
        shown.update(preemption_mode=settings.preemption_mode, swap_space_blocks=settings.swap_space_blocks or 0)
    return shown


def _settings_fields(values: dict) -> dict:
    """Form values (``form_values``' keys and units) as ``RunSpec`` fields."""
    fields = {k: v for k, v in values.items() if k in RunSpec.__dataclass_fields__}
    if "watermark_pct" in values:
        fields["watermark"] = float(values["watermark_pct"]) / 100
    if "swap_space_blocks" in values:
        fields["swap_space_blocks"] = int(values["swap_space_blocks"]) or None
    return fields


def overridden_fields(current: RunSpec, preset: str, chosen: dict, use_preset: bool = True) -> list[str]:
    """The form's fields changed in ``chosen`` that ``applied_settings`` takes from the preset instead (with
    "Use the preset's pool settings" ticked: the pool and what the preset fixes itself), in the form's keys;
    the page says so, rather than silently showing the preset's value again."""
    if preset == "custom" or not use_preset:
        return []
    shown = form_values(current, chosen.get("semantics", current.semantics))
    fixed = set(POOL_FIELDS) | preset_fixed_fields(preset)
    changed = [k for k, v in chosen.items() if k in shown and v != shown[k]]
    return [k for k in changed if k in fixed or _settings_fields({k: chosen[k]}).keys() & fixed]


def applied_settings(current: RunSpec, preset: str, chosen: dict, use_preset: bool = True) -> RunSpec:
    """The settings "Apply and reset" builds from the form: ``chosen`` holds what the form's widgets hold
    (``form_values``' keys, only the widgets drawn), ``current`` the settings in effect, which the form
    opened with. Only what was changed in the form counts; a value merely shown is not a choice.

    A preset is pure: with the tick ("Use the preset's pool settings"), applying preset X gives X's own
    settings (``preset_settings``) whatever ran before, plus what was changed in this form, except the pool
    (``POOL_FIELDS``) and what X fixes itself (``preset_fixed_fields``), which always come from X. Applying
    the preset already in effect keeps the earlier changes (the form shows them: what you see is what runs).
    Without the tick, or for "custom", the form's values apply to the settings in effect. The model is
    the form's either way, except that a preset's own model (one the preset names, e.g. hybrid-window's)
    left as it was in the form does not follow to another preset, which runs on its own model."""
    shown = form_values(current, chosen.get("semantics", current.semantics))
    changed = _settings_fields({k: v for k, v in chosen.items() if k in shown and v != shown[k]})
    model = str(chosen.get("model", current.model)).strip()
    changed.pop("model", None)
    if preset not in ("custom", current.preset) and model == current.model and current.preset != "custom":
        from engine.scenarios.presets import get_scenario

        if get_scenario(current.preset).model == model:  # the last preset's own model (hybrid-window's) was no
            model = EMBEDDED_MODEL  # choice: the new preset runs on its own (``RunSpec.from_preset``)
    if preset == "custom" or not use_preset:
        return dataclasses.replace(current, preset=preset, model=model, **changed)
    pure = preset_settings(preset, model)
    base = dataclasses.replace(current, model=model) if preset == current.preset else pure
    fixed = set(POOL_FIELDS) | preset_fixed_fields(preset)
    settings = dataclasses.replace(base, **{k: v for k, v in changed.items() if k not in fixed})
    return dataclasses.replace(settings, **{k: getattr(pure, k) for k in fixed})


# ------------------------------------------------------------------------------------------------ the stage
STAGE_KEY = "stage_keys"  # the press counter's key; its element container is hidden (class st-key-stage_keys)
# clicks the counter takes over, and the letter each press is logged as (``ui.lab.PRESS_KINDS``)
STAGE_BUTTONS = {"stage_step": "F", "stage_back": "B", "stage_play": "P", "stage_next": "N", "stage_end": "E"}

# Runs in the app page (components v2 mount no iframe). Installed once per page, whatever the number of
# renders; removed when the Playground is left. Counts every press of PageDown / PageUp (whatever widget has
# the focus: the keys never scroll the page or move a slider here), of P (Play / Pause) and N (next event),
# unless the focus is in a text field, and every click on the stage's buttons (``STAGE_BUTTONS``: a double
# click is two presses, not one coalesced button event), and hands Python the running total with the kinds
# of the last presses; it hands the same total again (``RETRY_MS``) until a render says the lab handled it all.
_STAGE_JS = """
export default function (component) {
  const { data, setStateValue, parentElement } = component;
  const LOG = 256;
  const w = window;
  let g = w.__pagedAttentionStage;
  // Streamlit can unmount the counter and mount it again within one redraw (a run interrupted by the next
  // press clears the fragment's elements it had not drawn yet): the counter, with the presses not yet
  // handled, outlives that, and is torn down only when no mount follows (the Playground was left).
  if (g && g.teardown) {
    clearTimeout(g.teardown);
    g.teardown = null;
  }
  if (!g) {
    g = { token: null, n: 0, log: "", send: null, owner: null, root: null, acked: 0, resent: 0, retry: null,
          delay: RETRY_MS };
    const TEXT = ["text", "search", "email", "url", "password", "tel", ""];
    const typing = (t) => !!t && (t.isContentEditable || t.tagName === "TEXTAREA"
      || (t.tagName === "INPUT" && !t.readOnly && TEXT.includes((t.type || "").toLowerCase())));
    g.report = () => {
      if (g.send) g.send("presses", { token: g.token, n: g.n, log: g.log, resent: g.resent });
    };
    // A report can be lost on its way (a rerun request dropped while the page reconnects, or aimed at a
    // fragment a full run has just replaced): until the server's render says it handled every press
    // (data.handled), the same total is sent again, 2 s after the last report, then 4 s, 8 s, 8 s, ...
    g.watch = () => {
      if (g.n <= g.acked) {
        clearTimeout(g.retry);
        g.retry = null;
        g.delay = RETRY_MS;
      } else if (!g.retry) {
        g.retry = setTimeout(() => {
          g.retry = null;
          if (g.n <= g.acked) return;
          g.resent += 1;
          if (g.root) g.root.dataset.resent = String(g.resent);
          g.report();
          g.delay = Math.min(2 * g.delay, RETRY_MAX_MS);
          g.watch();
        }, g.delay);
      }
    };
    g.press = (kind) => {
      g.n += 1;
      g.log = (g.log + kind).slice(-LOG);
      if (g.root) g.root.dataset.sent = String(g.n);
      g.report();
      clearTimeout(g.retry);  // a new report: the wait for its acknowledgement starts afresh
      g.retry = null;
      g.delay = RETRY_MS;
      g.watch();
    };
    g.onKey = (e) => {
      if (e.key === "PageDown" || e.key === "PageUp") {
        e.preventDefault();
        e.stopImmediatePropagation();
        if (!e.repeat) g.press(e.key === "PageDown" ? "F" : "B");
      } else if (["p", "P", "n", "N"].includes(e.key) && !e.ctrlKey && !e.metaKey && !e.altKey
                 && !typing(e.target)) {
        e.preventDefault();
        e.stopImmediatePropagation();
        if (!e.repeat) g.press(e.key.toUpperCase());
      }
    };
    g.onClick = (e) => {
      const t = e.target instanceof Element ? e.target : null;
      const box = t && t.closest(BUTTONS);
      const button = t && t.closest("button");
      if (!box || !button || !box.contains(button) || button.disabled) return;
      e.preventDefault();
      e.stopImmediatePropagation();
      g.press(KINDS[[...box.classList].find((c) => c in KINDS)] || "F");
    };
    w.addEventListener("keydown", g.onKey, true);
    w.addEventListener("click", g.onClick, true);
    if (!document.getElementById("paged-attention-stage-style")) {
      const style = document.createElement("style");
      style.id = "paged-attention-stage-style";
      style.textContent = ".st-key-" + KEY + " { display: none !important; }";
      document.head.appendChild(style);
    }
    w.__pagedAttentionStage = g;
  }
  const remounted = !g.owner;  // the first mount, or one after an unmount (which let go of the counter)
  const owner = {};
  g.owner = owner;
  g.send = setStateValue;
  const handled = (data && Number.isInteger(data.handled)) ? data.handled : 0;
  if (data && data.token !== g.token) {  // a new lab: its presses count from what it has handled
    g.token = data.token;
    g.n = handled;
    g.log = "";
  } else if (handled > g.n) {
    g.n = handled;
  }
  g.acked = handled;  // what the server has run of this lab's presses: the rest are re-sent until it has
  // presses counted while unmounted (or whose report went through the old mount's sender): reported now
  if (remounted && g.n > g.acked) g.report();
  g.watch();
  let root = parentElement.querySelector(".paged-attention-stage");
  if (!root) {
    root = document.createElement("div");
    root.className = "paged-attention-stage";
    parentElement.appendChild(root);
  }
  g.root = root;
  // the window's size, for the presenter view's figure heights: sent when Python's copy differs (first
  // render, a resize), so it never loops
  g.viewport = () => {
    if (!g.wantViewport) return;  // only the presenter view sizes its figures by the window
    const vp = { w: w.innerWidth, h: w.innerHeight };
    const known = g.knownViewport;
    if (!known || known.w !== vp.w || known.h !== vp.h) {
      g.knownViewport = vp;
      if (g.send) g.send("viewport", vp);
    }
  };
  g.knownViewport = (data && data.viewport) || null;
  g.wantViewport = !!(data && data.wantViewport);
  if (!g.onResize) {
    g.onResize = () => { clearTimeout(g.resizeTimer); g.resizeTimer = setTimeout(() => g.viewport(), 400); };
    w.addEventListener("resize", g.onResize);
  }
  g.viewport();
  for (const [k, v] of Object.entries((data && data.attrs) || {})) root.dataset[k] = String(v);
  root.dataset.sent = String(g.n);
  return () => {
    if (w.__pagedAttentionStage !== g || g.owner !== owner) return;  // a newer mount owns the counter
    g.owner = null;
    g.send = null;  // presses from now on are counted and reported by the next mount
    g.teardown = setTimeout(() => {
      if (w.__pagedAttentionStage !== g || g.owner) return;
      clearTimeout(g.retry);
      w.removeEventListener("keydown", g.onKey, true);
      w.removeEventListener("click", g.onClick, true);
      if (g.onResize) w.removeEventListener("resize", g.onResize);
      delete w.__pagedAttentionStage;
    }, TEARDOWN_MS);
  };
}
"""
_stage_component = None
# The counter re-sends its total while the server's render has not acknowledged every press: first this long
# after the last report (ms), then twice as long each time, at most RETRY_MAX_MS. Longer than a Step takes under
# the class load test's p95 (1.3 s), so a slow answer is rarely asked twice; a second ask only redraws the stage.
RETRY_MS = 2000
RETRY_MAX_MS = 8000
# An unmounted counter keeps counting this long (ms) for the mount that follows it within one redraw; with none
# (the Playground was left), it then stops taking PageDown / PageUp / P / N and the stage's clicks.
TEARDOWN_MS = 1000


def _stage_js() -> str:
    """``_STAGE_JS`` with the key of its own element and of the buttons it takes over."""
    import json

    kinds = {f"st-key-{k}": v for k, v in STAGE_BUTTONS.items()}
    return (f"const KEY = {json.dumps(STAGE_KEY)};\n"
            f"const BUTTONS = {json.dumps(', '.join('.' + c for c in kinds))};\n"
            f"const KINDS = {json.dumps(kinds)};\n"
            f"const RETRY_MS = {RETRY_MS}, RETRY_MAX_MS = {RETRY_MAX_MS}, TEARDOWN_MS = {TEARDOWN_MS};\n"
            + _STAGE_JS)


def _stage():
    global _stage_component
    if _stage_component is None:  # created on first use, inside a script run
        from streamlit.components import v2

        _stage_component = v2.component("paged_attention_stage", js=_stage_js(), isolate_styles=False)
    return _stage_component


def stage_keys(lab: Lab, want_viewport: bool = False) -> None:
    """Draw the stage's press counter (invisible) for ``lab``. It carries, as data attributes of its element
    (``.paged-attention-stage``), what a browser test compares: steps recorded, each engine's own step count,
    presses handled and ignored."""
    counts = lab.counts()
    attrs = {**counts, "token": lab.protocol.token, "contiguousSteps": "" if counts["contiguousSteps"] is None
             else counts["contiguousSteps"]}
    _stage()(key=STAGE_KEY, data={"token": lab.protocol.token, "handled": counts["handled"], "attrs": attrs,
                                  "viewport": viewport(), "wantViewport": want_viewport},
             on_presses_change=lambda: None, on_viewport_change=lambda: None, width="stretch", height="content")


def viewport() -> dict | None:
    """The browser window's size in CSS px, ``{"w": ..., "h": ...}``, as the stage's counter last sent it
    (None before it has: AppTest, the first script run)."""
    state = st.session_state.get(STAGE_KEY)
    vp = state.get("viewport") if hasattr(state, "get") else None
    if isinstance(vp, dict) and all(isinstance(vp.get(k), int) and 0 < vp[k] < 100_000 for k in ("w", "h")):
        return {"w": vp["w"], "h": vp["h"]}
    return None


def _browser_presses() -> dict:
    """The stage counter's last report: ``{"token", "n", "log"}`` (empty before it has sent one)."""
    state = st.session_state.get(STAGE_KEY)
    presses = state.get("presses") if hasattr(state, "get") else None
    return presses if isinstance(presses, dict) else {}


def pending_stage_presses(lab: Lab) -> str:
    """The kinds ("F", "B", "P", "N", "E") of the presses the browser counted that ``lab`` has not run yet
    (``Lab.pending_kinds``: a peek; ``take_stage_presses`` runs them)."""
    presses = _browser_presses()
    return lab.pending_kinds(presses.get("token"), presses.get("n"), presses.get("log"))


def take_stage_presses(lab: Lab) -> int:
    """Run the presses the browser counted since the last script run (``Lab.take_presses``: each exactly
    once, atomically). Returns how many were new."""
    presses = _browser_presses()
    return lab.take_presses(presses.get("token"), presses.get("n"), presses.get("log"))

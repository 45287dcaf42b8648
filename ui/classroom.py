"""Class: a class predicts the presenter's next step together.

The presenter starts a class (a join code, shown big), asks a question about THEIR Playground run's next
step (which block a request takes, how many blocks are free after it, who is preempted), watches the
predictions come in (a histogram, re-read every ``REFRESH_S`` by a fragment: only it redraws), then
presses "Step and reveal": one step of the presenter's own lab (the Playground's, in this browser session)
runs, and the right answer is read from that step's record (``ui.class_room_state.answer_from_record``).
Students open this page in their own browsers, type the code and submit one prediction each; after the
reveal they see the right answer and the histogram with the right bar marked.

The class lives in a process-wide ``ClassRegistry`` (``st.cache_resource``, like ``ui.server``'s
``live_registry``; with several worker processes, in the file they share: ``PAL_CLASS_STATE``) holding
only questions, predictions under anonymous ids and answers; a student's page reads a ``ClassView`` and
never the presenter's lab or another student's session.
"""

from __future__ import annotations

import html
import os

import streamlit as st

from ui.class_room_state import (NONE, NOBODY, QUESTION_KINDS, ClassRegistry, answer_from_record,
                                 make_question, new_student_id, normalize_code)
from ui import class_server
from ui.state import build_lab, default_settings, get_lab
from viz.classroom import predictions_figure

REFRESH_S = 1.0  # the live histogram and the students' view re-read the class this often
ROLES = ["Student", "Presenter"]
KIND_LABELS = {"next_block": "Which block will a request take next?",
               "free_after": "How many blocks will be free after the next step?",
               "preempted": "Who is preempted next?"}


STATE_ENV = "PAL_CLASS_STATE"  # a JSON file the classes live in, shared by a class server's worker processes


@st.cache_resource
def class_registry() -> ClassRegistry:
    """Every class on this server, shared by all sessions: in this process, or in the file ``PAL_CLASS_STATE``
    names (``scripts/class_server.py`` sets it, so a class spans its workers)."""
    return ClassRegistry(path=os.environ.get(STATE_ENV) or None)


def big_code(code: str) -> None:
    st.markdown(f"<div class='pal-class-code' style='font-size:5rem;font-weight:800;letter-spacing:0.4rem;"
                f"font-family:monospace'>{html.escape(code)}</div>", unsafe_allow_html=True)


# ------------------------------------------------------------------------------------- the projector view
# The presenter's screen is shown on a projector: every text at least the README's promise, 18 px at 720 lines
# and 27 at 1080 (``viz.presenter.presenter_sizes``: 2.5 % of the window's height, never under 18 px). The
# page's own text by CSS in ``vh`` (it follows the window with no round trip); headings and the join code keep
# their bigger sizes, grown alike. The sidebar's page list (its titles cut short at these sizes) and Streamlit's
# header are hidden, as in the Playground's presenter view; choosing Student brings them back. The histogram
# (Plotly sizes its text in px) gets its size from the window
# the viewport component below reports (before its first report: 27 px, the 1080-line promise).
PROJECTOR_CSS = """
<style>
[data-testid="stMain"] :is(p, span, label, li, a, button, input, textarea, div, code,
  small):not(h1 *, h2 *, h3 *, .pal-class-code, .js-plotly-plot *) { font-size: max(18px, 2.5vh) !important; }
[data-testid="stMain"] :is(h1, h1 *) { font-size: max(2.75rem, 6vh) !important; }
[data-testid="stMain"] :is(h2, h2 *, h3, h3 *) { font-size: max(27px, 3.4vh) !important; }
[data-testid="stMain"] .pal-class-code { font-size: max(5rem, 11vh) !important; line-height: 1.2 !important; }
[data-testid="stMain"] [data-testid="stWidgetLabel"] * { white-space: normal !important; overflow: visible !important; }
section[data-testid="stSidebar"], [data-testid="stSidebarCollapsedControl"], header[data-testid="stHeader"]
  { display: none !important; }
</style>
"""
VIEWPORT_KEY = "class_viewport"
_VIEWPORT_JS = """
export default function (component) {
  const { data, setStateValue } = component;
  const w = window;
  const send = () => {
    const vp = { w: w.innerWidth, h: w.innerHeight };
    const known = w.__palClassViewport || (data && data.viewport);
    if (!known || known.w !== vp.w || known.h !== vp.h) { w.__palClassViewport = vp; setStateValue("viewport", vp); }
  };
  let timer = null;
  const onResize = () => { clearTimeout(timer); timer = setTimeout(send, 400); };
  w.addEventListener("resize", onResize);
  send();
  return () => { clearTimeout(timer); w.removeEventListener("resize", onResize); };
}
"""
_viewport_component = None


def class_viewport() -> dict | None:
    """The window's size in CSS px (``{"w", "h"}``) as a small invisible component last reported it (None
    before its first report, and in AppTest): sent on the first render and after a resize, only when it
    differs from what the server holds, so it never loops."""
    global _viewport_component
    state = st.session_state.get(VIEWPORT_KEY)
    vp = state.get("viewport") if hasattr(state, "get") else None
    known = vp if isinstance(vp, dict) and all(isinstance(vp.get(k), int) and 0 < vp[k] < 100_000
                                               for k in ("w", "h")) else None
    if _viewport_component is None:
        from streamlit.components import v2

        _viewport_component = v2.component("pal_class_viewport", js=_VIEWPORT_JS, isolate_styles=False)
    _viewport_component(key=VIEWPORT_KEY, data={"viewport": known}, on_viewport_change=lambda: None,
                        width="stretch", height="content")
    return {"w": known["w"], "h": known["h"]} if known else None


def projector_font() -> int:
    """The histogram's smallest type (px) for this window: ``presenter_sizes``' (18 at 720 lines, 27 at
    1080), or 27 before the window's size is known."""
    from viz.presenter import presenter_sizes

    vp = class_viewport()
    return presenter_sizes(vp["h"])["font"] if vp else 27


def choice_label(choice: str) -> str:
    return {NONE: "none (no new block)", NOBODY: "nobody"}.get(choice, choice)


# --------------------------------------------------------------------------------------------- presenter
def presenter() -> None:
    st.markdown(PROJECTOR_CSS, unsafe_allow_html=True)
    st.session_state["class_font"] = projector_font()
    registry = class_registry()
    code = st.session_state.get("class_code_presenting")
    if code is not None and not registry.exists(code):
        st.warning(f"Class {code} has ended or expired.")
        code = st.session_state["class_code_presenting"] = None
    if code is None:
        st.write("Start a class, show its code, and ask about your Playground run's next step.")
        if st.button("Start a class", type="primary", key="class_start"):
            try:
                st.session_state["class_code_presenting"] = registry.open_class()
            except RuntimeError as exc:
                st.error(str(exc))
            st.rerun()
        return
    lab = get_lab()
    if lab is None:
        if not build_lab(default_settings()):
            class_server.lab_refused(st.session_state.get("lab_error"), key="class_retry")  # + Try again
            return
        lab = get_lab()
    st.caption("Join code: students open this page (Class), choose Student and type it. (Projector view: the "
               "page list is hidden; choose Student above to get it back.)")
    big_code(code)
    if st.button("End the class", key="class_end"):
        registry.close(code)
        st.session_state["class_code_presenting"] = None
        st.rerun()
    ask_form(registry, code, lab)
    st.fragment(run_every=REFRESH_S)(presenter_live)(registry, code)
    step_and_reveal(registry, code, lab)


def ask_form(registry, code: str, lab) -> None:
    """Choose and open a question about the lab's next step; the lab's step count is kept with it, so the
    reveal reads exactly the step after it."""
    _, _, has_work = lab.frame()
    num_blocks = lab.run.paged.num_blocks  # the paged pool's size in blocks (also when sized from a KV budget)
    with st.form("class_ask"):
        kind = st.selectbox("Question", QUESTION_KINDS, format_func=KIND_LABELS.get, key="class_kind")
        target = st.selectbox("About request (for 'which block')", lab.run.order or ["(none yet)"], key="class_target")
        asked = st.form_submit_button("Open the question", type="primary")
    if not asked:
        return
    if not has_work:
        st.error("Your Playground run has nothing left to step: Reset it (Playground) first.")
        return
    if kind == "next_block" and not lab.run.order:
        st.error("No request has arrived in your Playground run yet, so there is no request to ask about: ask "
                 "how many blocks will be free, or step once first.")
        return
    try:
        question = make_question(kind, int(num_blocks), lab.run.order, target if kind == "next_block" else None)
        number = registry.ask(code, question)
    except (KeyError, ValueError) as exc:
        st.error(f"Question not opened: {exc}")
        return
    st.session_state["class_asked"] = (code, number, lab.protocol.token, lab.step_count)


def presenter_live(registry, code: str) -> None:
    try:
        view = registry.view(code, presenter=True)
    except KeyError as exc:
        st.warning(str(exc))
        return
    if view.question is None:
        st.info("No question yet: choose one above and open it.")
        return
    st.subheader(f"Question {view.number}: {view.question.text}")
    st.caption(f"{view.answered} prediction{'s' * (view.answered != 1)} so far"
               + (f"; right answer: **{choice_label(view.answer)}**" if view.revealed else ""))
    if view.counts:
        st.plotly_chart(predictions_figure(view.counts, view.answer, font_px=st.session_state.get("class_font", 27)),
                        width="stretch", key="class_hist_presenter", config={"displayModeBar": False})


def step_and_reveal(registry, code: str, lab) -> None:
    asked = st.session_state.get("class_asked")
    if not asked or asked[0] != code:
        return
    _, number, token, step = asked
    try:
        shown = registry.view(code)
    except KeyError:
        return
    if shown.number != number or shown.revealed:  # revealed (or another question opened): nothing to step for
        return
    if not st.button("Step and reveal", type="primary", key="class_reveal",
                     help="Runs one step of your Playground run (unless you stepped it there already) and "
                          "reveals the answer read from that step's record"):
        return
    view = registry.view(code, presenter=True)
    if view.number != number or view.revealed:
        st.warning("This question is revealed already: open a new one.")
        return
    if lab.protocol.token != token:
        st.error("Your Playground run was reset since the question was asked: open a new question.")
        return
    if lab.step_count <= step:  # not stepped in the Playground meanwhile: step now, as the Playground would
        lab.seek(-1)
        if lab.press("forward") != "stepped":
            st.error(f"No step ran: {lab.protocol.ignored_why}.")
            return
        st.session_state["cursor"] = lab.player.cursor
    record = lab.record(step)[0]  # the paged engine's record of the step right after the question
    before = lab.record(step - 1)[0].snapshot if step > 0 else None
    try:
        registry.reveal(code, answer_from_record(view.question, record, before))
    except (KeyError, ValueError) as exc:
        st.error(f"Not revealed: {exc}")
        return
    st.rerun()


# ----------------------------------------------------------------------------------------------- student
def student() -> None:
    registry = class_registry()
    sid = st.session_state.setdefault("class_student_id", new_student_id())
    code = st.session_state.get("class_code_joined")
    if code is None:
        with st.form("class_join"):
            typed = st.text_input("Join code (from the presenter's screen)", key="class_code_typed", max_chars=12)
            joined = st.form_submit_button("Join", type="primary")
        if joined:
            if registry.exists(typed):
                st.session_state["class_code_joined"] = normalize_code(typed)
                st.rerun()
            st.error(f"No class with code {normalize_code(typed)!r}: check the code on the presenter's screen.")
        return
    st.caption(f"In class **{code}**")
    if st.button("Leave", key="class_leave"):
        st.session_state["class_code_joined"] = None
        st.rerun()
    st.fragment(run_every=REFRESH_S)(student_live)(registry, code, sid)


def student_live(registry, code: str, sid: str) -> None:
    try:
        view = registry.view(code, student=sid)
    except KeyError:
        st.warning(f"Class {code} has ended.")
        return
    if view.question is None:
        st.info("Waiting for the presenter's first question...")
        return
    st.subheader(f"Question {view.number}: {view.question.text}")
    if view.revealed:
        right = view.mine == view.answer
        st.success(f"Right answer: **{choice_label(view.answer)}**. "
                   + ("You predicted it." if right else
                      f"You predicted {choice_label(view.mine)}." if view.mine else "You did not predict."))
        st.plotly_chart(predictions_figure(view.counts, view.answer), width="stretch", key="class_hist_student")
        return
    choices = list(view.question.choices)
    mine = view.mine if view.mine in choices else None
    pick = st.selectbox("Your prediction", choices, index=choices.index(mine) if mine else None,
                        format_func=choice_label, key=f"class_pick_{view.number}")
    # a refused submit is said until the next try: this fragment re-runs every second, and a message drawn
    # only in the run of the click would vanish before it is read
    refused = f"class_refused_{view.number}"
    if st.button("Submit" if mine is None else "Change my prediction", key=f"class_submit_{view.number}"):
        try:
            if pick is None:
                raise ValueError("choose a prediction first")
            registry.submit(code, sid, pick, number=view.number)
            mine = pick
            st.session_state.pop(refused, None)
        except (KeyError, ValueError) as exc:
            st.session_state[refused] = f"Not submitted: {exc}"
    if said := st.session_state.get(refused):
        st.error(said)
    st.caption(f"Your prediction: **{choice_label(mine)}** (you may change it until the reveal)" if mine else
               "No prediction submitted yet.")


def main() -> None:
    st.title("Class")
    role = st.radio("I am", ROLES, horizontal=True, key="class_role")
    if role == "Presenter":
        presenter()
    else:
        student()


main()

"""A class at once: the presenter's question about the next step, students' predictions, the reveal.

Plain Python (no Streamlit, no engine import, no figures), so it is tested directly; the Class page
(``ui/classroom.py``) keeps one ``ClassRegistry`` per server process (``st.cache_resource``) and draws it.

The flow: the presenter starts a class (``ClassRegistry.open_class``: a short join code), asks a question
about THEIR Playground run's next step (``make_question``: its choices are fixed when asked), students
join with the code and each submit one prediction (``submit``: validated against the choices; one per
student per question, changeable until the reveal), the presenter sees the tally live (``view``), runs
the step, and the reveal reads the right answer from that step's record (``answer_from_record``): nothing
is predicted by re-running or copying the engines.

What the registry holds, and all it holds: per class the code, the question (text and choices), each
student's prediction under an anonymous id the student's own session made up (``new_student_id``), and
after the reveal the right answer. No session id, no lab, no request text: a student reads only a
``ClassView`` (the question, the counts, its own prediction), never another student's id.

Bounds: at most ``max_classes`` classes per server and ``max_students`` per class; a class whose
presenter has not touched it for ``ttl_s`` seconds expires (its code stops working and may be reused).
Thread-safe: every method holds the registry's lock (Streamlit runs each session's script in its own
thread). Shared between processes when given a ``path`` (a class server with several workers,
``scripts/class_server.py``, sets ``PAL_CLASS_STATE``): the presenter and the students may be served by
different processes, so every method then reads the classes from that JSON file and writes them back under an
exclusive ``fcntl.flock`` of ``<path>.lock`` (a class holds a few KB; each page reads it about once a second).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import secrets
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

# Join codes: no 0/O, 1/I/L, so a code read off a projector is typed right. 5 characters of 31: ~28.6M codes.
CODE_ALPHABET = "ABCDEFGHJKMNPQRSTUVWXYZ23456789"
CODE_LENGTH = 5
MAX_CLASSES = 50
MAX_STUDENTS = 200
TTL_S = 3 * 3600.0  # a class lives 3 hours after the presenter's last action or view

NONE = "none"        # next_block: the request takes no new block in the next step
NOBODY = "nobody"    # preempted: no request is preempted in the next step

# question kind -> its text ({target}: a request id); each kind's answer is read by ``answer_from_record``
QUESTION_TEXT = {
    "next_block": "Which physical block will {target} take in the next step? (\"none\" if it takes no new block)",
    "free_after": "How many blocks will be free after the next step?",
    "preempted": "Who is preempted in the next step?",
}
QUESTION_KINDS = tuple(QUESTION_TEXT)


def new_code(taken=(), rng=secrets.SystemRandom()) -> str:
    """A fresh join code of ``CODE_LENGTH`` characters of ``CODE_ALPHABET`` not in ``taken``."""
    while True:
        code = "".join(rng.choice(CODE_ALPHABET) for _ in range(CODE_LENGTH))
        if code not in taken:
            return code


def normalize_code(text: str) -> str:
    """A code as typed (any case, spaces or dashes in it) in its canonical form: "ab-c 2d" -> "ABC2D"."""
    return "".join(ch for ch in str(text).upper() if ch.isalnum())


def new_student_id() -> str:
    """An anonymous student id (random, 16 hex digits): a student's session keeps it for its predictions."""
    return secrets.token_hex(8)


def request_of(seq_id: str) -> str:
    """The request a sequence belongs to: "R3.1" (sample), "R3.b2" (beam) -> "R3"; "R3" -> "R3"."""
    return str(seq_id).split(".", 1)[0]


@dataclass(frozen=True)
class Question:
    """What the presenter asks: ``kind`` (one of ``QUESTION_KINDS``), ``text``, the ``choices`` a student
    picks from (strings: block ids, counts, request ids, or ``NONE`` / ``NOBODY``) and ``target`` (the
    request ``next_block`` asks about, else None)."""

    kind: str
    text: str
    choices: tuple[str, ...]
    target: str | None = None


def make_question(kind: str, num_blocks: int, requests, target: str | None = None) -> Question:
    """The question ``kind`` about the next step of a paged pool of ``num_blocks`` blocks with these
    ``requests`` (request ids, in the run's order).

    Choices: next_block: every physical block id and ``NONE``; free_after: 0..num_blocks (blocks);
    preempted: every request and ``NOBODY``. Raises ValueError for an unknown kind, a pool of no blocks, or
    a ``next_block`` target that is not one of ``requests``."""
    requests = [str(r) for r in requests]
    if kind not in QUESTION_TEXT:
        raise ValueError(f"unknown question kind {kind!r}: choose one of {', '.join(QUESTION_KINDS)}")
    if not isinstance(num_blocks, int) or num_blocks < 1:
        raise ValueError(f"num_blocks must be a positive number of blocks, got {num_blocks!r}")
    if kind == "next_block":
        if target not in requests:
            raise ValueError(f"target request {target!r} is not in this run (its requests: {', '.join(requests) or 'none'})")
        choices = tuple(str(b) for b in range(num_blocks)) + (NONE,)
    elif kind == "free_after":
        target = None
        choices = tuple(str(n) for n in range(num_blocks + 1))
    else:
        target = None
        choices = tuple(requests) + (NOBODY,)
    return Question(kind, QUESTION_TEXT[kind].format(target=target), choices, target)


def answer_from_record(question: Question, record, before=None) -> str:
    """The right answer to ``question``, read from the paged engine's ``StepRecord`` of the step asked about;
    ``before``: the snapshot of the step before it (None before the first step).

    next_block: the first block the step added to the target's block tables (the target's sequences), in
    event order: a ``new_block`` event's block, a copy-on-write's destination, a ``swap_in``'s GPU block,
    or the first block of an ``allocate`` (admission or prefill chunk) that none of its tables held in
    ``before`` (a prefix-cache hit is added to the table too, so it counts); ``NONE`` if the step added
    none. free_after: ``record.snapshot.num_free_blocks``. preempted: the request of the first ``preempt``
    event, or ``NOBODY``. Raises ValueError for an answer that is not one of the question's choices (the
    run changed under the question)."""
    if question.kind == "next_block":
        answer = _first_block_taken(question.target, record, before)
    elif question.kind == "free_after":
        answer = str(record.snapshot.num_free_blocks)
    else:
        preempts = [e.request_id for e in record.events if e.kind == "preempt"]
        answer = NOBODY
        if preempts:
            answer = preempts[0] if preempts[0] in question.choices else request_of(preempts[0])
    if answer not in question.choices:
        raise ValueError(f"the step's answer {answer!r} is not one of the question's choices "
                         f"({', '.join(question.choices[:20])}{', ...' if len(question.choices) > 20 else ''})")
    return answer


def _first_block_taken(target: str, record, before) -> str:
    held = {b for s in (before.sequences if before is not None else [])
            if request_of(s.seq_id) == target and s.status != "swapped" for b in s.block_table}  # GPU tables
    for e in record.events:
        if e.kind == "swap_in" and any(request_of(s) == target for s in e.data.get("seqs", [])):
            fresh = [gpu for _, gpu in e.data.get("pairs", [])]
        elif request_of(e.request_id or "") != target:
            continue
        elif e.kind == "new_block":
            fresh = e.blocks[:1]
        elif e.kind == "cow":
            fresh = e.blocks[1:2]  # [source, destination]: the copy is the block taken
        elif e.kind == "allocate":
            fresh = [b for b in e.blocks if b not in held]
        else:
            continue
        if fresh:
            return str(fresh[0])
    return NONE


@dataclass(frozen=True)
class ClassView:
    """One reading of a class, for a page: the question (None before the first), its number (1, 2, ...),
    the counts per choice that got a prediction (in the choices' order), how many predicted, the right
    answer (None until revealed) and ``mine``, the prediction of the student who asked (None if none)."""

    code: str
    question: Question | None
    number: int
    counts: dict[str, int]
    answered: int
    answer: str | None
    mine: str | None = None

    @property
    def revealed(self) -> bool:
        return self.answer is not None


@dataclass
class ClassRoom:
    code: str
    touched: float
    question: Question | None = None
    number: int = 0  # questions asked so far
    predictions: dict[str, str] = field(default_factory=dict)  # anonymous student id -> choice
    students: set[str] = field(default_factory=set)  # ids that ever predicted in this class (bounded)
    answer: str | None = None


def _room_to_json(room: ClassRoom) -> dict:
    return {**dataclasses.asdict(room), "students": sorted(room.students)}


def _dump(classes: dict[str, ClassRoom]) -> str:
    return json.dumps({code: _room_to_json(room) for code, room in classes.items()}, sort_keys=True)


def _room_from_json(data: dict) -> ClassRoom:
    q = data.get("question")
    question = Question(q["kind"], q["text"], tuple(q["choices"]), q.get("target")) if q else None
    return ClassRoom(data["code"], float(data["touched"]), question, int(data["number"]),
                     dict(data["predictions"]), set(data["students"]), data.get("answer"))


class ClassRegistry:
    """Every class of this server (see the module docstring): kept in this process, or with ``path`` in that
    JSON file, shared by every process given the same path. ``now`` arguments are for tests (seconds: of
    ``time.time``'s clock with a ``path``, the one processes share; else ``time.monotonic``'s)."""

    def __init__(self, max_classes: int = MAX_CLASSES, max_students: int = MAX_STUDENTS, ttl_s: float = TTL_S,
                 path: str | None = None):
        self.max_classes, self.max_students, self.ttl_s = max_classes, max_students, ttl_s
        self.path = path
        self._classes: dict[str, ClassRoom] = {}
        self._thread_lock = threading.Lock()

    @contextmanager
    def _lock(self):
        """This registry's lock; with a ``path``, also the file's: the classes are read before and written
        after, when they changed (students' pages read the class every second; most reads change nothing)."""
        with self._thread_lock:
            if self.path is None:
                yield
                return
            with open(self.path + ".lock", "a") as lock_file:
                fcntl.flock(lock_file, fcntl.LOCK_EX)  # released when the file is closed
                before = self._read()
                yield
                after = _dump(self._classes)
                if after != before:
                    self._write(after)

    def _read(self) -> str:
        """Load the classes from the file; returns its text ("{}" when there is none yet). A file that cannot
        be parsed (a disk that filled up, a hand edit) is moved aside to ``<path>.bad`` and the classes start
        empty, rather than every page of the class failing on it."""
        try:
            with open(self.path) as f:
                text = f.read()
            self._classes = {code: _room_from_json(room) for code, room in json.loads(text).items()}
            return text
        except FileNotFoundError:
            self._classes = {}
            return _dump({})
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            logging.getLogger(__name__).error("class state %s unreadable (%s): moved to %s.bad, starting empty",
                                              self.path, exc, self.path)
            os.replace(self.path, self.path + ".bad")
            self._classes = {}
            return _dump({})

    def _write(self, text: str) -> None:
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, self.path)  # readers see the old file or the new one, never half of one

    def __len__(self) -> int:
        with self._lock():
            return len(self._classes)

    def _now(self, now: float | None) -> float:
        if now is not None:
            return now
        # shared by processes: the clock they share; alone: one no wall-clock change can jump
        return time.time() if self.path is not None else time.monotonic()

    def _sweep(self, now: float) -> None:
        for code in [c for c, room in self._classes.items() if now - room.touched > self.ttl_s]:
            del self._classes[code]

    def _room(self, code: str, now: float) -> ClassRoom:
        self._sweep(now)
        room = self._classes.get(normalize_code(code))
        if room is None:
            raise KeyError(f"no class with code {normalize_code(code)!r} (mistyped, ended or expired)")
        return room

    def open_class(self, now: float | None = None) -> str:
        """Start a class; returns its join code. Raises RuntimeError when ``max_classes`` are running."""
        now = self._now(now)
        with self._lock():
            self._sweep(now)
            if len(self._classes) >= self.max_classes:
                raise RuntimeError(f"this server already runs {len(self._classes)} classes (at most "
                                   f"{self.max_classes}); end one or wait until one expires")
            code = new_code(self._classes)
            self._classes[code] = ClassRoom(code, now)
            return code

    def close(self, code: str) -> None:
        """End the class ``code`` (its code stops working); an unknown code is ignored."""
        with self._lock():
            self._classes.pop(normalize_code(code), None)

    def exists(self, code: str, now: float | None = None) -> bool:
        now = self._now(now)
        with self._lock():
            self._sweep(now)
            return normalize_code(code) in self._classes

    def ask(self, code: str, question: Question, now: float | None = None) -> int:
        """Open ``question`` in class ``code`` (the previous one and its predictions are dropped); returns its
        number. Raises KeyError for an unknown or expired code."""
        now = self._now(now)
        with self._lock():
            room = self._room(code, now)
            room.question, room.answer, room.predictions = question, None, {}
            room.number += 1
            room.touched = now
            return room.number

    def submit(self, code: str, student: str, choice: str, number: int | None = None,
               now: float | None = None) -> None:
        """Student ``student``'s prediction ``choice`` for the open question (``number``: the question the
        student saw; a prediction for an older one is refused). Replaces the student's earlier one.

        Raises KeyError (unknown or expired code) or ValueError naming what is wrong: no question open, the
        answer already revealed, a stale question number, a choice not offered, the class full."""
        now = self._now(now)
        choice = str(choice).strip()
        with self._lock():
            room = self._room(code, now)
            if room.question is None:
                raise ValueError("no question is open in this class yet: wait for the presenter")
            if number is not None and number != room.number:
                raise ValueError(f"question {number} is over; question {room.number} is open now")
            if room.answer is not None:
                raise ValueError(f"question {room.number} is revealed already: predictions are closed")
            if choice not in room.question.choices:
                raise ValueError(f"prediction {choice!r} is not one of the choices "
                                 f"({', '.join(room.question.choices[:20])}"
                                 f"{', ...' if len(room.question.choices) > 20 else ''})")
            if student not in room.students and len(room.students) >= self.max_students:
                raise ValueError(f"this class is full ({self.max_students} students)")
            room.students.add(student)
            room.predictions[student] = choice

    def reveal(self, code: str, answer: str, now: float | None = None) -> None:
        """Close the open question with its right ``answer`` (one of its choices). Raises KeyError (unknown
        code) or ValueError (no question open, an answer not among the choices)."""
        now = self._now(now)
        with self._lock():
            room = self._room(code, now)
            if room.question is None:
                raise ValueError("no question is open in this class")
            if answer not in room.question.choices:
                raise ValueError(f"answer {answer!r} is not one of the question's choices")
            room.answer = answer
            room.touched = now

    def view(self, code: str, student: str | None = None, presenter: bool = False,
             now: float | None = None) -> ClassView:
        """A consistent reading of class ``code`` for a page; ``student``: whose own prediction to include.
        ``presenter``: the presenter's view, which also keeps the class alive (``ttl_s``). Counts list only
        choices somebody predicted, plus the right answer once revealed. Raises KeyError for an unknown or
        expired code."""
        now = self._now(now)
        with self._lock():
            room = self._room(code, now)
            if presenter:
                room.touched = now
            counts = tally(room.question, room.predictions.values(), room.answer)
            return ClassView(room.code, room.question, room.number, counts, len(room.predictions), room.answer,
                             room.predictions.get(student) if student is not None else None)


def tally(question: Question | None, predictions, answer: str | None = None) -> dict[str, int]:
    """How many predicted each choice, in the question's order of choices, for the choices predicted at
    least once and the right ``answer`` (0 if nobody chose it)."""
    if question is None:
        return {}
    counts: dict[str, int] = {}
    for p in predictions:
        counts[p] = counts.get(p, 0) + 1
    shown = set(counts) | ({answer} if answer is not None else set())
    return {c: counts.get(c, 0) for c in question.choices if c in shown}

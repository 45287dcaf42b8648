"""Wording found by a learner trial (issue 23 follow-up): every sentence of a lesson's reveal ends before the
next begins, and lesson 1's KV-bytes question asks what the request stores."""

from __future__ import annotations

import importlib
import re

import pytest
import torch

from engine import EMBEDDED_MODEL
from engine.model_loader import load_model
from lessons.common import LessonContext


@pytest.fixture(scope="module")
def ctx():
    return LessonContext(loaded=load_model(EMBEDDED_MODEL, torch.device("cpu"), "float32"))


def test_lesson5_fallback_reveal_ends_the_engines_message_before_the_next_sentence(ctx):
    ex = importlib.import_module("lessons.l5_out_of_memory").exercises(ctx)["m_fallback"]
    # a lower-case word or number followed by a capital with no full stop between: a run-on
    assert not re.search(r"[a-z0-9]\*? That is", ex.explanation), ex.explanation
    assert re.search(r"[.!?]\*? That is this engine's choice", ex.explanation), ex.explanation


def test_lesson1_kv_bytes_question_asks_what_the_request_stores(ctx):
    ex = importlib.import_module("lessons.l1_kv_cache").exercises(ctx)["run_bytes"]
    assert "does the request store" in ex.question and "hold" not in ex.question

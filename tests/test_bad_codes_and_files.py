"""Issue 23, item 13: a scenario file, a scenario link and a progress code that are not what they claim are
refused with a ValueError naming what is wrong, never an AttributeError or a MemoryError."""

from __future__ import annotations

import base64
import json
import os
import zlib

import pytest

from engine.scenarios import scenario_file as sf
from engine.scenarios.url_codec import pack, unpack
from lessons import progress


def test_a_device_that_reports_no_size_is_read_with_a_cap():
    # /dev/zero's st_size is 0 and it never ends: an uncapped read raised MemoryError
    with pytest.raises(ValueError, match=r"/dev/zero: the scenario file is more than 262,144 bytes"):
        sf.load_scenario("/dev/zero")


def test_a_pipe_is_read_no_further_than_the_cap(tmp_path):
    fifo = tmp_path / "scenario.json"
    os.mkfifo(fifo)
    pid = os.fork()
    if pid == 0:  # the writer: more than the cap, then it is killed when the reader stops reading
        try:
            with open(fifo, "wb") as out:
                out.write(b" " * (sf.MAX_FILE_BYTES + 10))
        finally:
            os._exit(0)
    try:
        with pytest.raises(ValueError, match="is more than 262,144 bytes"):
            sf.load_scenario(fifo)
    finally:
        os.waitpid(pid, 0)


MINIMAL = {"version": 1, "name": "minimal", "requests": [{"prompt_token_ids": [40, 41, 42]}]}


def test_a_file_within_the_cap_still_loads(tmp_path):
    path = tmp_path / "ok.json"
    path.write_text(json.dumps(MINIMAL))
    assert sf.load_scenario(path) == sf.parse_scenario(MINIMAL)


@pytest.mark.parametrize("value", [None, b"abc", 42, ["x"]])
def test_a_link_or_code_that_is_not_text_is_refused_by_type(value):
    with pytest.raises(ValueError, match=f"the scenario link must be text, got {type(value).__name__}"):
        sf.decode_link(value)
    with pytest.raises(ValueError, match=f"the progress code must be text, got {type(value).__name__}"):
        progress.decode(value)


def test_bytes_after_the_zlib_stream_are_refused():
    good = zlib.compress(b'{"v": 1}', 9)
    for tail in (b"\0", b"junk", zlib.compress(b"more", 9)):
        value = base64.urlsafe_b64encode(good + tail).decode().rstrip("=")
        with pytest.raises(ValueError, match=rf"the link is damaged \({len(tail)} bytes? after its end\)"):
            unpack(value, "the link", 1000, 1000)
    assert unpack(pack(b'{"v": 1}'), "the link", 1000, 1000) == b'{"v": 1}'


def test_a_link_with_trailing_bytes_is_refused():
    code = sf.encode_link(sf.parse_scenario(MINIMAL))
    assert sf.decode_link(code) == sf.parse_scenario(MINIMAL)
    raw = base64.urlsafe_b64decode(code + "=" * (-len(code) % 4))
    with pytest.raises(ValueError, match=r"the scenario link is damaged \(1 byte after its end\)"):
        sf.decode_link(base64.urlsafe_b64encode(raw + b"!").decode())


def _code(payload) -> str:
    return pack(json.dumps(payload).encode())


@pytest.mark.parametrize("version, said", [(True, "true"), (1.0, "1.0"), ("1", '"1"'), (2, "2"), (None, "null")])
def test_a_progress_code_version_must_be_the_integer_1(version, said):
    with pytest.raises(ValueError, match=rf"not a version-1 code of this app \(its version is {said}\)"):
        progress.decode(_code({"v": version, "s": ["l1_paging"]}))


def test_a_progress_code_of_version_1_is_read():
    assert progress.decode(_code({"v": 1, "s": ["l1_paging"]})).shown == {"l1_paging"}
    with pytest.raises(ValueError, match=r"not a version-1 code of this app$"):
        progress.decode(_code([1]))


# ------------------------------------------------------------------------------ issue 23 trial findings
def _link(payload) -> str:
    return pack(json.dumps(payload).encode() if not isinstance(payload, str) else payload.encode())


def test_a_link_over_the_class_request_cap_says_the_cap_its_count_and_what_to_do(monkeypatch):
    """A link with more requests than a class server runs was told "press Reset for a fresh run" (Reset does
    nothing for a link) and "(64 added already)"; it is refused when opened, with the cap, its own count and
    what to do instead."""
    from infra import class_limits as limits
    from ui.scenario_io import link_settings, read_file  # the app opens links and files (its policy: class_limits)
    monkeypatch.setenv(limits.CLASS_SERVER_ENV, "1")
    cap = limits.class_limits().max_requests
    many = {"version": 1, "name": "many", "requests": [{"prompt": "a", "arrival_step": i} for i in range(cap + 1)]}
    with pytest.raises(ValueError) as err:
        link_settings(_link(many))
    said = str(err.value)
    assert said.startswith(f"this scenario link has {cap + 1} requests, more than the {cap} one run may hold on "
                           f"this class server; open a link with fewer requests")
    assert said.endswith("or run it on a machine of your own (the app started there with streamlit run app.py, "
                         "outside class mode, has no such cap)") and "Reset" not in said
    with pytest.raises(ValueError, match=rf"this scenario file has {cap + 1} requests, .*remove some requests"):
        read_file(json.dumps(many))
    # V1 runs a request's n samples as child requests: they count
    v1 = {"version": 1, "name": "v1", "semantics": "v1", "requests": [{"prompt": "a", "n": 8}] * 9}
    with pytest.raises(ValueError, match=r"has 72 requests \(in V1 each of a request's n samples is a request of its "
                                         r"own: 9 requests make 72\), more than the 64"):
        link_settings(_link(v1))
    assert len(link_settings(_link({**v1, "semantics": "paper"})).scenario.requests) == 9  # the paper's: 9 requests
    monkeypatch.delenv(limits.CLASS_SERVER_ENV)
    assert len(link_settings(_link(many)).scenario.requests) == cap + 1  # no cap outside a class server


DEEP_MESSAGE = ("is not a scenario: its lists and mappings are nested more than 16 levels deep (a scenario has 4: "
                "the file, its requests, a request, its token ids)")


@pytest.mark.parametrize("text", ["[" * 5000 + "]" * 5000, "[" * 200_000, "[" * 17 + "]" * 17,
                                  '{"a": ' * 3000 + "1" + "}" * 3000,
                                  '{"name": "x", "requests": [' + "[" * 20 + "]" * 20 + "]}"])
def test_a_deeply_nested_link_and_file_get_one_same_message(text):
    """The link said "damaged (it does not hold a scenario's JSON)" where the same file said "nested too
    deep": one message, for a link, a JSON file and a YAML file, whether the parser gave up or not."""
    if len(text) < 10_000:  # a link inflates to at most 256 KiB; 200,000 "[" compress well within it anyway
        with pytest.raises(ValueError) as link:
            sf.decode_link(_link(text))
        assert str(link.value) == "the scenario link " + DEEP_MESSAGE
    for fmt in ("json", "yaml"):
        with pytest.raises(ValueError) as file:
            sf.parse_text(text, fmt)
        assert str(file.value) == "the scenario file " + DEEP_MESSAGE, fmt


HUGE = "9" * 5000


@pytest.mark.parametrize("field, said", [
    ("max_tokens", "requests.0.max_tokens: must be <= 32768, got an integer of 5,000 digits"),
    ("seed", "requests.0.seed: must be < 4611686018427387904, got an integer of 5,000 digits"),
    ("temperature", "requests.0.temperature: must have at most 40 digits, got an integer of 5,000 digits"),
])
def test_a_5000_digit_integer_is_refused_naming_its_field_and_limit(field, said):
    """Python's own "Exceeds the limit (4300 digits) for integer string conversion" reached the page; now the
    field's own check refuses it by name, in a link, a JSON file and a YAML file alike."""
    text = '{"version": 1, "name": "x", "requests": [{"prompt": "a", "%s": %s}]}' % (field, HUGE)
    for read in (lambda: sf.decode_link(_link(text)), lambda: sf.parse_text(text, "json"),
                 lambda: sf.parse_text(text, "yaml")):
        with pytest.raises(ValueError) as err:
            read()
        assert str(err.value) == said
        assert "4300" not in str(err.value)
    negative = text.replace(HUGE, "-" + HUGE)
    with pytest.raises(ValueError, match=r"got a negative integer of 5,000 digits"):
        sf.parse_text(negative)


def test_a_huge_integer_outside_the_requests_is_named_too():
    with pytest.raises(ValueError, match=r"^settings\.num_blocks: must be <= 65536, got an integer of 41 digits$"):
        sf.parse_text('{"name": "x", "settings": {"num_blocks": %s}}' % ("1" * 41))
    assert sf.parse_text('{"name": "x", "seed": %s}' % ("1" * 18)).seed == int("1" * 18)  # ordinary sizes read


def test_the_page_says_why_a_link_over_the_class_cap_is_not_opened(monkeypatch):
    """What the student reads: the link's count, the cap, and what to do; no "press Reset"."""
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    from infra import class_limits as limits
    monkeypatch.setenv(limits.CLASS_SERVER_ENV, "1")
    many = {"version": 1, "name": "many", "requests": [{"prompt": "a", "arrival_step": i} for i in range(65)]}
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=180)
    at.query_params["scenario"] = sf.encode_link(sf.parse_scenario(many))
    at.run()
    assert not at.exception
    said = [e.value for e in at.error]
    assert any("cannot be opened: this scenario link has 65 requests, more than the 64 one run may hold on this "
               "class server; open a link with fewer requests" in e for e in said), said
    assert not any("Reset" in e for e in said)
    assert at.session_state["lab"].run.paged is not None  # the default run is shown instead

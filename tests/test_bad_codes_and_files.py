"""Issue 23, item 13: a scenario file, a scenario link and a progress code that are not what they claim are
refused with a ValueError naming what is wrong, never an AttributeError or a MemoryError."""

from __future__ import annotations

import base64
import json
import os
import zlib

import pytest

from engine import scenario_file as sf
from engine.url_codec import pack, unpack
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

"""engine/scenarios/url_codec.py: bytes into a URL query value and back, every bad value refused by name and limit."""

from __future__ import annotations

import base64
import zlib

import pytest

from engine.scenarios.url_codec import pack, unpack


def test_round_trip_in_url_safe_characters():
    raw = '{"name":"r\u00e9sum\u00e9","n":[1,2,3]}'.encode() * 20
    value = pack(raw)
    assert set(value) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
    assert len(value) < len(raw)  # compressed
    assert unpack(f"  {value}\n", "the link", 1000, 10_000) == raw
    assert unpack(value + "=" * (-len(value) % 4), "the link", 1000, 10_000) == raw  # pasted with padding


@pytest.mark.parametrize("value, says", [
    ("", "the link is empty"),
    ("x" * 101, "the link is 101 characters, more than 100"),
    ("abc$def", "the link has characters other than letters, digits, '-' and '_'"),
    ("abcd", "the link is damaged (cut short or mistyped?)"),  # not zlib
    (pack(b"x" * 500)[:-4], "the link is damaged (cut short or mistyped?)"),  # cut short
    (base64.urlsafe_b64encode(zlib.compress(b"\0" * 5000, 9)).decode(), "the link holds more than 1,000 bytes"),
])
def test_bad_values_are_refused_naming_what_is_wrong(value, says):
    with pytest.raises(ValueError) as err:
        unpack(value, "the link", 100, 1000)
    assert str(err.value) == says

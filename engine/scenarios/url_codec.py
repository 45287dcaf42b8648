"""Bytes packed into a URL query value and back: zlib, then base64url without padding (letters, digits, "-", "_").

Used by the scenario links (``engine.scenarios.scenario_file.encode_link``) and the lessons' progress codes
(``lessons.progress.encode``). ``unpack`` reads a value typed or pasted by anyone, so it bounds everything
before it trusts anything: the value's length, its characters, and the bytes it inflates to (a short value can
inflate to gigabytes: a zip bomb); each refusal is a ValueError naming the value (``what``) and the limit.
"""

from __future__ import annotations

import base64
import re
import zlib

_VALUE = re.compile(r"[A-Za-z0-9_-]+={0,2}")  # "=" padding is not written, but accepted when pasted


def pack(raw: bytes) -> str:
    """``raw`` compressed (zlib, level 9) as base64url text without "=" padding."""
    return base64.urlsafe_b64encode(zlib.compress(raw, 9)).decode().rstrip("=")


def unpack(value: str, what: str, max_chars: int, max_bytes: int) -> bytes:
    """The bytes ``pack`` made ``value`` from (surrounding spaces ignored). ``what`` names the value in the
    errors ("the scenario link"). Raises ValueError when it is not text (None, bytes, a number), empty,
    longer than ``max_chars`` characters, has other characters than base64url's, is damaged (cut short,
    mistyped, not zlib, or with bytes after the end of its zlib stream: ``pack`` never writes any), or
    inflates to more than ``max_bytes`` bytes."""
    if not isinstance(value, str):
        raise ValueError(f"{what} must be text, got {type(value).__name__}")
    value = value.strip()
    if not value:
        raise ValueError(f"{what} is empty")
    if len(value) > max_chars:
        raise ValueError(f"{what} is {len(value):,} characters, more than {max_chars:,}")
    if not _VALUE.fullmatch(value):
        raise ValueError(f"{what} has characters other than letters, digits, '-' and '_'")
    value = value.rstrip("=")
    damaged = f"{what} is damaged (cut short or mistyped?)"
    try:
        inflate = zlib.decompressobj()
        raw = inflate.decompress(base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)), max_bytes)
    except (zlib.error, ValueError):  # binascii.Error is a ValueError
        raise ValueError(damaged) from None
    if inflate.unconsumed_tail:  # stopped at max_bytes with input left: a small value that inflates to more
        raise ValueError(f"{what} holds more than {max_bytes:,} bytes")
    if not inflate.eof:  # the compressed stream stops before its end: the value was cut short
        raise ValueError(damaged)
    if inflate.unused_data:  # bytes after the stream's end: not what pack wrote (two values pasted together?)
        extra = len(inflate.unused_data)
        raise ValueError(f"{what} is damaged ({extra:,} byte{'s' * (extra != 1)} after its end)")
    return raw

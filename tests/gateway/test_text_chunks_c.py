"""The text-chunk hashes in C (``text_chunk_hashes``, gpuhit/_speedups.c, on OpenSSL's BLAKE2b)
against their reference, :func:`gateway.http.prompt.text_chunk_hashes` (hashlib's): the same ints
on every text, at chunk boundaries, across multi-byte UTF-8 and lone surrogates, for empty and short
texts; and :class:`gateway.http.parse.Prompts` routes text by either, with the same answer."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engines.hashing import BlockHasher, SessionHashCache
from gateway.http.parse import Prompts
from gateway.http.prompt import text_chunk_hashes

SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# every kind of str: ASCII, Latin-1, two-, three- and four-byte code points, lone surrogates (category
# Cs, which st.characters draws rarely: named as well)
TEXT = st.text(alphabet=st.one_of(st.sampled_from(["a", "\n", "\xe9", "\u20ac", "\U0001f600", "\ud800", "\udfff"]),
                                  st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=())),
               max_size=300)


class _Str(str):
    """A str subclass (its characters kept apart from the object, unlike a plain str's)."""


def test_the_definition():
    """BLAKE2b-512 of the previous 8-byte digest and the chunk, cut to 8 bytes, big-endian."""
    first = hashlib.blake2b(b"a" * 64).digest()[:8]
    second = hashlib.blake2b(first + b"b" * 64).digest()[:8]
    assert text_chunk_hashes("a" * 64 + "b" * 64 + "c" * 63, 64) == [int.from_bytes(first, "big"),
                                                                    int.from_bytes(second, "big")]
    assert text_chunk_hashes("é", 1) == [int.from_bytes(hashlib.blake2b(b"\xc3").digest()[:8], "big"),
                                         int.from_bytes(hashlib.blake2b(
                                             hashlib.blake2b(b"\xc3").digest()[:8] + b"\xa9").digest()[:8], "big")]


@pytest.mark.parametrize("text", [
    "", "a", "x" * 63, "x" * 64, "x" * 65, "x" * 127, "x" * 128, "x" * 129,  # around the boundaries
    "é" * 32, "x" + "é" * 40, "€" * 30, "x" + "€" * 30, "😀" * 20, "xy" + "😀" * 40,  # code points cut by a chunk
    "a\ud800b" * 30, "\udfff" * 50, "\ud83d\ude00" * 20,  # lone surrogates, passed through as their 3 bytes
    _Str("x" * 100), _Str("é" * 100),
    "system\nYou are a helpful coding assistant.\nuser\nRequest 0-1: what does this function return?\n",
])
@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64, 200])
def test_c_and_reference_agree(c_speedups, text, chunk):
    assert c_speedups.text_chunk_hashes(text, chunk) == text_chunk_hashes(text, chunk)


@SETTINGS
@given(TEXT, st.integers(1, 80))
def test_c_and_reference_agree_on_any_text(c_speedups, text, chunk):
    assert c_speedups.text_chunk_hashes(text, chunk) == text_chunk_hashes(text, chunk)


def test_bad_arguments_are_refused_alike(c_speedups):
    for chunk in (0, -64):
        with pytest.raises(ValueError, match="chunk_bytes must be positive"):
            text_chunk_hashes("x" * 100, chunk)
        with pytest.raises(ValueError, match="chunk_bytes must be positive"):
            c_speedups.text_chunk_hashes("x" * 100, chunk)
    with pytest.raises(TypeError):
        c_speedups.text_chunk_hashes(b"x" * 100, 64)


def test_prompts_hash_text_alike_with_and_without_c(c_speedups):
    def prompts(accel):
        return Prompts("m", SessionHashCache(BlockHasher(16)), 16, text_chunk_chars=64, accel=accel)

    text = "user\n" + "Ünïcödé and ascii " * 20
    assert prompts(c_speedups).text(text) == prompts(None).text(text)
    assert len(prompts(None).text(text)[1]) == len(text.encode()) // 64

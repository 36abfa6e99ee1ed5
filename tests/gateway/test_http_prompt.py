"""Prompt hashing for routing: exact incremental hashes per session, approximate text chunks."""

from __future__ import annotations

from engines.hashing import BlockHasher, SessionHashCache
from gateway.http.prompt import chat_text, text_chunk_hashes


def test_reference_vector_and_incremental_reuse():
    hasher = BlockHasher(16)
    cache = SessionHashCache(hasher)
    turn1 = list(range(1000, 1032)) + [7, 8, 9]
    assert cache.hashes(turn1, "s") == [7322446309363477352, 17027874615116373601]
    assert cache.blocks_hashed == 2
    turn2 = turn1 + list(range(50, 80))  # extends turn 1: only the new full blocks are hashed
    got = cache.hashes(turn2, "s")
    assert got == hasher.event_ints(turn2)
    assert cache.blocks_hashed == 2 + 2
    # A diverging prompt in the same session re-hashes from the first different block only.
    turn3 = turn1[:16] + [1] * 40
    assert cache.hashes(turn3, "s") == hasher.event_ints(turn3)
    assert cache.blocks_hashed == 4 + 2
    # No session header: keyed by the first block; still exact.
    assert cache.hashes(turn2, None) == hasher.event_ints(turn2)
    assert cache.hashes(list(range(5)), "s") == []


def test_text_chunks_are_prefix_stable():
    a = text_chunk_hashes("x" * 130, 64)
    b = text_chunk_hashes("x" * 200, 64)
    assert len(a) == 2 and b[:2] == a and len(b) == 3
    assert text_chunk_hashes("y" * 130, 64)[0] != a[0]
    assert chat_text([{"role": "user", "content": [{"type": "text", "text": "hi"}]}]) == "user\nhi\n"

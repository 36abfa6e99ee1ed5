"""Prompt hashing for routing: exact incremental hashes per session, approximate text chunks."""

from __future__ import annotations

import json
import random

import numpy as np
import orjson
import pytest

from engines.hash_functions import HASH_FUNCTIONS, to_event_int
from engines.hashing import BlockHasher, SessionHashCache, event_ints_of
from gateway.http.prompt import PromptMemo, chat_text, fast_completion_ids, text_chunk_hashes
from gateway.http.token_ids import parse_ids
from gpuhit.errors import GpuhitError


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


# --------------------------------------------------------------------------- the fast token-id path

_ITEMS = ["0", "7", "255", "256", "65535", "65536", "2147483647", "2147483648", "123456789012345678",
          "1234567890123456789", "18446744073709551615", "18446744073709551616", "-1", "-0", "1.5", "1e3",
          "01", "00", "[1,2]", "[]", "true", "null", '"x"', "", "1 2", "{}"]
_SEPS = [",", ", ", " ,", ",\n", "\t,\r ", ",,", " "]
_PRE = ['{"model":"m","prompt":', '{"model":"prompt","prompt":', '{"stop":["prompt"],"prompt": ', '{ "prompt" : ', '{"x":{"prompt":', '{"prompt": 5, "prompt":',
        '{"a\\"prompt":[1],"prompt":', '{"prompt":[9],"x":{"prompt":', '["prompt":', '{"prompt"\n:\t']
_POST = ["}", ',"max_tokens":4}', ',"stop":["prompt"]}', ',"prompt":[7]}', ', "stream": true}', "", ",}", ',"pr\\u006fmpt":[3]}',
         ' ,"max_tokens": 4 } ', "}}", ',"x":"\\"prompt\\": [1]"}']


def _random_body(rng: random.Random) -> bytes:
    n = rng.randrange(0, 9)
    items = [rng.choice(_ITEMS) if rng.random() < 0.3 else str(rng.randrange(0, 200_000)) for _ in range(n)]
    seps = [rng.choice(_SEPS) if rng.random() < 0.4 else "," for _ in range(max(n - 1, 0))]
    text = "".join(a + (seps[i] if i < len(seps) else "") for i, a in enumerate(items))
    arr = "[" + rng.choice(["", " ", "\n"]) + text + rng.choice(["", " ", "\t"]) + "]"
    return (rng.choice(_PRE) + arr + rng.choice(_POST)).encode()


def test_fast_ids_equal_orjson_or_step_aside():
    """The fast path returns exactly what orjson parses (prompt as ids, the rest of the body equal),
    or None, for random odd bodies: whitespace, signs, floats, nested arrays, leading zeros,
    64-bit overflow, escaped / nested / duplicate "prompt" keys, invalid JSON."""
    rng = random.Random(18)
    taken = 0
    for _ in range(4000):
        raw = _random_body(rng)
        got = fast_completion_ids(raw)
        if got is None:
            continue
        taken += 1
        doc = orjson.loads(raw)  # the fast path never accepts what orjson refuses
        body, ids = got
        assert isinstance(doc, dict) and doc["prompt"] == ids.tolist(), raw
        assert all(type(x) is int and 0 <= x < 1 << 63 for x in doc["prompt"]), raw
        doc.pop("prompt")
        assert "prompt" not in body, raw
        assert body == doc, raw
    assert taken > 150  # the generator does reach the fast path


def test_parse_ids_large_and_rejects():
    rng = np.random.default_rng(18)
    ids = rng.integers(0, 10**18, 5000).tolist() + [0, 9, 10]
    for sep in (b",", b", ", b" ,\n"):
        text = sep.join(str(i).encode() for i in ids)
        raw = b"[ " + text + b"\t]"
        got = parse_ids(raw, 1, len(raw) - 1)
        assert got is not None and got.tolist() == ids
    for bad in (b"", b" ", b"1,", b",1", b"1,,2", b"1 2", b"01", b"-1", b"1.0", b"1e2", b"[1]", b"1234567890123456789"):
        assert parse_ids(bad, 0, len(bad)) is None, bad


def test_prompt_memo_parses_only_the_extension():
    memo = PromptMemo()
    base = list(range(1000, 1300))
    for turn, (sep, more) in enumerate([(",", [5, 6]), (" , ", [7]), (",\n", list(range(40)))]):
        prompt = base + more
        head = orjson.dumps({"model": "m", "prompt": base}).decode().split("]")[0]
        raw = (head + sep + ",".join(map(str, more)) + '],"max_tokens":4}').encode()
        fast_completion_ids(orjson.dumps({"model": "m", "prompt": base}), memo, "s")
        before = memo.reused
        body, ids = fast_completion_ids(raw, memo, "s")
        assert ids.tolist() == prompt and body["max_tokens"] == 4 and memo.reused == before + 1
        base = prompt
    # not an extension: a changed id, a number continued, a different session -> parsed whole, still right
    prev = orjson.dumps({"prompt": [1, 2, 3]})
    for raw, want in ((b'{"prompt":[1,2,4,5]}', [1, 2, 4, 5]), (b'{"prompt":[1,2,34]}', [1, 2, 34]),
                      (b'{"prompt":[1,2,3]}', [1, 2, 3]), (b'{"prompt":[1,2,3] ,"x":"prompt"}', [1, 2, 3]),
                      (b'{"prompt":[1,2,3 4]}', None), (b'{"prompt":[1,2,3,]}', None)):
        fast_completion_ids(prev, memo, "t")
        got = fast_completion_ids(raw, memo, "t")
        assert (None if got is None else got[1].tolist()) == want, raw


@pytest.mark.parametrize("algo", ["sha256", "xxhash", "sha256_cbor"])
@pytest.mark.parametrize("block_size", [16, 4, 3])
def test_hash_array_is_bit_exact(algo, block_size):
    if algo == "xxhash":
        pytest.importorskip("xxhash")
    hasher = BlockHasher(block_size, algo, "0")
    rng = np.random.default_rng(block_size)
    for top in (256, 65536, 1 << 31, 1 << 40):
        t = rng.integers(0, top, 40 * block_size + 5, dtype=np.uint64)
        t[:4] = [255, 256, 65535, 65536]
        got = hasher.hash_array(t)
        assert got == hasher.hash_blocks(t.tolist())
        parent = got[3]
        assert hasher.hash_array(t[4 * block_size :], parent) == got[4:]
        assert event_ints_of(got) == [to_event_int(d) for d in got]
    assert HASH_FUNCTIONS[algo]  # the algorithm exists as vLLM names it


def test_session_cache_array_path_matches_reference():
    hasher = BlockHasher(16)
    cache = SessionHashCache(hasher)
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 150_000, 16 * 300 + 7, dtype=np.uint64)
    assert cache.hashes_array(prompt, "s") == hasher.event_ints(prompt.tolist())
    longer = np.concatenate((prompt, rng.integers(0, 150_000, 512, dtype=np.uint64)))
    before = cache.blocks_hashed
    assert cache.hashes_array(longer, "s") == hasher.event_ints(longer.tolist())
    assert cache.blocks_hashed - before == len(longer) // 16 - len(prompt) // 16
    forked = longer.copy()
    forked[16 * 100 + 3] += 1
    assert cache.hashes_array(forked, "s") == hasher.event_ints(forked.tolist())
    assert cache.hashes_array(prompt[:40], "s") == hasher.event_ints(prompt[:40].tolist())


def _completions(fast_ids: bool, **kw):
    from gateway.http.parse import Completions, Prompts

    prompts = Prompts("m", SessionHashCache(BlockHasher(16)), 16, max_model_len=200_000, **kw)
    return Completions(prompts, fast_ids=fast_ids)


def _outcome(dialect, raw):
    from gateway.http.token_ids import TokenIds

    try:
        r = dialect.parse(raw, "s")
    except GpuhitError as exc:
        return (type(exc).__name__, str(exc), getattr(exc, "param", None), int(exc.http_status)), False
    fast = type(r.prompt_ids) is TokenIds
    return (r.prompt_tokens, r.max_tokens, r.stream, list(r.block_hashes), None if r.prompt_ids is None else list(r.prompt_ids)), fast


def test_gateway_fast_and_full_parse_agree_on_large_bodies():
    """Bodies past FAST_PARSE_MIN_BYTES: the fast path's answer or error is exactly the full
    parse's, and where it steps aside the dialect parses whole as before."""
    from gateway.http.prompt import FAST_PARSE_MIN_BYTES

    fast, full = _completions(True, vocab_size=150_000), _completions(False, vocab_size=150_000)
    rng = random.Random(7)
    big = ",".join(str(rng.randrange(150_000)) for _ in range(20_000))
    bodies = [
        '{"model":"m","prompt":[IDS],"max_tokens":4}',
        '{"model":"other","prompt":[IDS]}',
        '{"prompt":[IDS],"max_tokens":0}',
        '{"prompt":[IDS],"max_tokens":4,"stream":"yes"}',
        '{"prompt":[IDS,150000]}',
        '{"prompt":[IDS,-1]}',
        '{"prompt":[IDS,1.5]}',
        '{"prompt":[[IDS]]}',
        '{"prompt":[IDS],"max_tokens":300000}',
        '{"prompt":[IDS] "max_tokens":4}',
        '{"prompt":[IDS],}',
        '[{"prompt":[IDS]}]',
        '{"prompt":[IDS], "prompt": "text"}',
    ]
    took = 0
    for template in bodies:
        raw = template.replace("IDS", big).encode()
        assert len(raw) >= FAST_PARSE_MIN_BYTES
        got, _ = _outcome(fast, raw)
        want, full_fast = _outcome(full, raw)
        assert not full_fast
        took += fast_completion_ids(raw) is not None  # the fast path answered (or raised) this one
        assert got == want, template[-40:]
    assert took >= 5


def test_lazy_prompt_hashes_read_like_the_eager_list_and_hash_only_what_is_read():
    hasher = BlockHasher(16)
    cache = SessionHashCache(hasher)
    rng = np.random.default_rng(11)
    prompt = rng.integers(0, 150_000, 16 * 200 + 5, dtype=np.uint64)
    eager = hasher.event_ints(prompt.tolist())
    lazy = cache.hashes_array(prompt, "s")
    assert len(lazy) == 200 and lazy.computed == 0 and cache.blocks_hashed == 0
    assert lazy[3] == eager[3] and lazy.computed == 4
    assert lazy[-1] == eager[-1] and lazy.computed == 200
    assert lazy[10:20] == eager[10:20] and lazy[::-7] == eager[::-7] and list(lazy) == eager
    with pytest.raises(IndexError):
        lazy[200]
    # The session's next prompt takes the digests over; the earlier prompt still reads its own.
    head = cache.hashes_array(prompt[: 16 * 50], "t")
    assert head[9] == eager[9]
    longer = cache.hashes_array(prompt, "t")  # extends `head` (10 blocks hashed): takes its lists
    assert longer[120] == eager[120]
    assert head[49] == eager[49] and list(head) == eager[:50]  # `head` copied its part before extending
    assert list(longer) == eager


@pytest.mark.parametrize("chained", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_the_index_search_over_lazy_hashes_answers_as_over_the_list_and_hashes_about_twice_the_hit(seed, chained):
    from gateway.kv_tiers import ChainTier, ParentedTier

    hasher = BlockHasher(16)
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 150_000, 16 * 300, dtype=np.uint64)
    eager = hasher.event_ints(prompt.tolist())
    for trial in range(30):
        blocks = ChainTier() if chained else ParentedTier()
        held = int(rng.integers(0, 301))
        keep = list(range(held))
        if trial % 3 == 0 and held > 2:  # a hole below the held run's end
            keep.remove(int(rng.integers(1, held)))
        for k in keep:
            blocks.add(eager[k], eager[k - 1] if k else None)
        if trial % 5 == 0:  # unrelated blocks
            for x in rng.integers(0, 1 << 62, 50).tolist():
                blocks.add(x, None)
        lazy = SessionHashCache(hasher).hashes_array(prompt)
        hit = blocks.prefix_hit(lazy)
        assert hit == blocks.prefix_hit(eager) == next((k for k in range(300) if eager[k] not in blocks.blocks), 300)
        assert lazy.computed <= min(300, 2 * max(hit, held) + 2)  # (a hole: searched to the held run's end)


def test_ids_without_a_session_are_checked_whole_but_parsed_only_as_far_as_they_are_read():
    from gateway.http.token_ids import LazyIds

    rng = random.Random(4)
    ids = [rng.randrange(0, 200_000) for _ in range(30_000)]
    for text in (orjson.dumps(ids), ", ".join(map(str, ids)).encode(), b"[ " + b" ,\n".join(b"%d" % i for i in ids) + b" ]"):
        raw = b'{"model":"m","prompt":' + (text if text.startswith(b"[") else b"[" + text + b"]") + b',"max_tokens":4}'
        _, lazy = fast_completion_ids(raw)
        assert isinstance(lazy, LazyIds) and len(lazy) == 30_000 and lazy.parsed == 0
        assert lazy[:16].tolist() == ids[:16] and lazy.parsed < 30_000
        assert lazy[-1] == ids[-1] and lazy.parsed == 30_000
        assert lazy.tolist() == ids and int(lazy.max()) == max(ids) and np.asarray(lazy).tolist() == ids
    # checked whole before anything is read: a bad id far down the array refuses the fast path
    assert fast_completion_ids(b'{"prompt":[' + b"1," * 20_000 + b'01]}') is None
    assert fast_completion_ids(b'{"prompt":[' + b"1," * 20_000 + b'1234567890123456789]}') is None
    assert fast_completion_ids(b'{"prompt":[' + b"1," * 20_000 + b'-1]}') is None
    # a lazily parsed prompt hashes like the parsed one, reading only what it hashes
    cache = SessionHashCache(BlockHasher(16))
    _, lazy = fast_completion_ids(b'{"prompt":' + orjson.dumps(ids) + b"}")
    h = cache.hashes_array(lazy)
    assert h[0] == BlockHasher(16).event_ints(ids[:16])[0] and lazy.parsed < 30_000
    assert list(h) == BlockHasher(16).event_ints(ids)


def test_completing_a_superseded_prompt_hashes_nothing():
    """The gateway completes a named session's hashes after forwarding; when the session's next
    prompt arrived first, it has taken over, and the earlier chain is not finished for nothing."""
    cache = SessionHashCache(BlockHasher(16))
    rng = np.random.default_rng(2)
    turn1 = rng.integers(0, 150_000, 16 * 100, dtype=np.uint64)
    turn2 = np.concatenate((turn1, rng.integers(0, 150_000, 16 * 4, dtype=np.uint64)))
    first = cache.hashes_array(turn1, "s")
    assert first[0] and cache.blocks_hashed == 1
    second = cache.hashes_array(turn2, "s")  # before first.complete() ran
    first.complete()
    assert cache.blocks_hashed == 1 and first.computed == 1
    second.complete()
    assert cache.blocks_hashed == 104 and list(second) == BlockHasher(16).event_ints(turn2.tolist())


def test_the_prompt_memo_is_bounded_in_bytes():
    memo = PromptMemo(max_sessions=100, max_bytes=1_000_000)
    for i in range(20):
        ids = np.arange(i, i + 20_000, dtype=np.uint64)
        memo.remember(f"s{i}", b"x" * 100_000, ids)
        assert memo.bytes <= 1_000_000 and memo.bytes == sum(len(t) + a.nbytes for t, a, _ in memo._last.values())
    assert len(memo._last) == 3


def test_the_prompt_memo_serves_session_less_repeats_and_checks_what_it_learnt():
    """Without a session the memo is keyed by how the array text starts: a repeated prompt reuses the
    ids, an extension parses only its new ids. An entry learnt from a body parsed whole is used only
    once its text is checked to be its ids' own: text with spaces, or a nested "prompt" array met
    before the top-level one, is forgotten at first use (the caller then parses whole, still right)."""
    from gateway.http.prompt import FAST_PARSE_MIN_BYTES

    memo = PromptMemo()
    ids = list(range(100_000, 100_000 + 1000))
    raw = orjson.dumps({"model": "m", "prompt": ids, "max_tokens": 4})
    assert len(raw) >= FAST_PARSE_MIN_BYTES
    body, got = fast_completion_ids(raw, memo, None)  # nothing learnt yet: parsed, then remembered
    assert np.asarray(got).tolist() == ids and memo.reused == 0
    body, got = fast_completion_ids(raw, memo, None)
    assert np.asarray(got).tolist() == ids and body["max_tokens"] == 4 and memo.reused == 1
    longer = orjson.dumps({"model": "m", "prompt": ids + [5, 6, 7], "max_tokens": 4})
    body, got = fast_completion_ids(longer, memo, None)
    assert got.tolist() == ids + [5, 6, 7] and memo.reused == 2
    # spaced text (json.dumps' default), learnt from a body parsed whole: refused at first use,
    # forgotten, and the body parsed anew
    spaced = json.dumps({"model": "m", "prompt": ids[::-1]}).encode()
    memo.learn(spaced, None, np.array(ids[::-1], dtype=np.uint64))
    body, got = fast_completion_ids(spaced, memo, None)
    assert np.asarray(got).tolist() == ids[::-1] and memo.reused == 2
    assert all(t[2] for t in memo._last.values())
    # a nested "prompt" array before the top-level one: its text is not the learnt ids'
    nested = orjson.dumps({"x": {"prompt": ids[:500] * 2}, "prompt": ids[::-1]})
    memo.learn(nested, None, np.array(ids[::-1], dtype=np.uint64))
    assert fast_completion_ids(nested, memo, None) is None  # not the top-level prompt: parse it whole
    again = orjson.dumps({"model": "m", "prompt": ids[:500] * 2})
    body, got = fast_completion_ids(again, memo, None)
    assert np.asarray(got).tolist() == ids[:500] * 2 and memo.reused == 2

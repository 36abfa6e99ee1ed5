"""The C speedups (gpuhit/_speedups.c) against the pure-Python path they stand in for: the same
answer for every input, valid or not, or None (and the Python path decides). Built for the test run
by the ``c_speedups`` fixture (tests/conftest.py)."""

from __future__ import annotations

import random

import msgpack
import msgspec
import numpy as np
import pytest

from engines import kv_event_codec as codec
from engines.kv_event_codec import ARRAY, CURRENT, VLLM, KVEventDecodeError, encode_batch
from engines.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from gateway.http import prompt
from gpuhit import speedups
from gpuhit.errors import ConfigError

# ------------------------------------------------------------------------------ token-id arrays

_ALPHABET = b"0123456789,, \t\n\r-+.eE[]x0"


def _numpy_ids(text: bytes) -> list[int] | None:
    v = prompt._validated(text, 0, len(text))
    return None if v is None else prompt._parse_text(v[0]).tolist()


def _c_ids(accel, text: bytes, pad: bytes = b"") -> list[int] | None:
    raw = pad + text + pad
    buf = accel.parse_uint_array(raw, len(pad), len(pad) + len(text))
    return None if buf is None else np.frombuffer(buf, dtype=np.uint64).tolist()


def _random_array_text(rng: random.Random) -> bytes:
    # A third are the common shape, long runs of short ids and bare commas (the C parser's fast
    # loop), with now and then a long number or whitespace that sends it to its general loop.
    plain = rng.random() < 0.3
    n = rng.choice([20, 300] if plain else [1, 2, 3, 7, 50])
    nums = []
    for _ in range(n):
        digits = rng.choice([1, 2, 5, 6, 7, 7, 7, 7, 7, 7, 8] if plain else [1, 1, 2, 5, 6, 7, 8, 9, 16, 17, 18, 19, 20])
        nums.append(str(rng.randrange(10 ** (digits - 1) if digits > 1 else 0, 10**digits)).encode())
    seps = [b"," if plain and rng.random() < 0.98 else rng.choice([b",", b",", b", ", b" ,\n", b"\t,\r"])
            for _ in range(n - 1)]
    text = b"".join(a + (seps[i] if i < len(seps) else b"") for i, a in enumerate(nums))
    return rng.choice([b"", b" ", b"\n"]) + text + rng.choice([b"", b" ", b"\t"])


def _mutate(rng: random.Random, text: bytes) -> bytes:
    b = bytearray(text)
    for _ in range(rng.randrange(1, 4)):
        op = rng.random()
        at = rng.randrange(len(b) + 1)
        if op < 0.4 or not b:
            b.insert(at, rng.choice(_ALPHABET))
        elif op < 0.7:
            del b[min(at, len(b) - 1)]
        else:
            b[min(at, len(b) - 1)] = rng.choice(_ALPHABET)
    return bytes(b)


def test_c_token_id_parser_answers_as_numpy_for_valid_and_broken_arrays(c_speedups):
    """Valid arrays (numbers of 1-20 digits around the 8-byte blocks the C parser reads at once,
    JSON whitespace anywhere between numbers) and random corruptions of them (signs, fractions,
    exponents, brackets, leading zeros, empty elements, split numbers): C and numpy agree exactly,
    wherever in the buffer the text lies."""
    rng = random.Random(2024)
    accepted = refused = 0
    for trial in range(6000):
        text = _random_array_text(rng)
        if trial % 2:
            text = _mutate(rng, text)
        want = _numpy_ids(text)
        for pad in (b"", b"9", b"[1,2,3,4,5,6,7,8]"):  # the neighbours must not be read
            assert _c_ids(c_speedups, text, pad) == want, (text, pad)
        accepted += want is not None
        refused += want is None
    assert accepted > 2000 and refused > 1500


def test_c_token_id_parser_blocks_agree_with_numpy_around_every_byte(c_speedups):
    """The parser's 64-byte blocks (an array of digits and commas only, every number's end from the
    commas' bit mask): one byte changed, inserted or removed at every position of arrays several
    blocks long, of 1-digit ids (32 numbers a block) and of mixed 1-8-digit ids, so that every
    kind of fault (whitespace, a leading zero, an empty element, a long number, a stray byte) lands
    at every offset from a block's start, on a number cut by a block's end, and in the last 80 bytes
    that the blocks leave to the other loops: C and numpy agree exactly."""
    rng = random.Random(64)
    texts = [b",".join(b"%d" % rng.randrange(10) for _ in range(100)),
             b",".join(b"%d" % rng.randrange(10 ** rng.randrange(1, 9)) for _ in range(40))]
    for text in texts:
        assert _c_ids(c_speedups, text) == _numpy_ids(text) is not None
        for at in range(len(text)):
            for b in (b" ", b"0", b"7", b",", b"x", b"\n"):
                for changed in (text[:at] + b + text[at + 1:], text[:at] + b + text[at:]):
                    assert _c_ids(c_speedups, changed, b"5") == _numpy_ids(changed), (changed, at)
            removed = text[:at] + text[at + 1:]
            assert _c_ids(c_speedups, removed) == _numpy_ids(removed), (removed, at)


@pytest.mark.parametrize("text, want", [
    (b"0", [0]), (b"00", None), (b"0,0", [0, 0]), (b"10", [10]), (b"01", None), (b"1,01", None),
    (b"12345678", [12345678]), (b"123456789", [123456789]), (b"12345678,1", [12345678, 1]),
    (b"999999999999999999", [999999999999999999]), (b"1000000000000000000", None),
    (b"1,999999999999999999,2", [1, 999999999999999999, 2]), (b"", None), (b" ", None), (b",", None),
    (b"1,", None), (b",1", None), (b"1,,2", None), (b"1 2", None), (b"1 ,\n 2 ", [1, 2]), (b"-1", None),
    (b"1.0", None), (b"1e2", None), (b"\x001", None), (b"1\x00", None), (b"1:2", None),
    (b"12345670,12345671,12345672,12345673", [12345670, 12345671, 12345672, 12345673]),
])
def test_c_token_id_parser_edges(c_speedups, text, want):
    assert _numpy_ids(text) == want
    assert _c_ids(c_speedups, text) == want


def test_c_token_id_parser_checks_its_arguments(c_speedups):
    with pytest.raises(ValueError, match="outside a buffer of 3 bytes"):
        c_speedups.parse_uint_array(b"1,2", 0, 4)
    with pytest.raises(ValueError):
        c_speedups.parse_uint_array(b"1,2", 2, 1)
    with pytest.raises(TypeError):
        c_speedups.parse_uint_array(b"1,2", 0)
    with pytest.raises(TypeError):
        c_speedups.parse_uint_array("1,2", 0, 3)  # text, not bytes
    assert np.frombuffer(c_speedups.parse_uint_array(memoryview(b"[5,6]"), 1, 4), np.uint64).tolist() == [5, 6]


# ------------------------------------------------------------------------------ KV-event batches


def _random_batch(rng: random.Random, trial: int) -> KVEventBatch:
    events = []
    for _ in range(rng.randrange(0, 5)):
        kind = rng.random()
        if kind < 0.55:
            n = rng.choice([1, 2, 16, 17, 300])
            width = rng.choice([7, 8, 16, 17, 32, 33, 63, 64])
            toks = tuple(rng.randrange(0, 1 << rng.choice([7, 8, 16, 20, 31, 40])) for _ in range(16 * n))
            events.append(BlockStored(
                tuple(rng.randrange(1 << width) for _ in range(n)), rng.choice([None, 0, rng.randrange(1 << 64)]),
                toks, rng.choice([1, 16, 32]), rng.choice([None, 0, 7, -3]), rng.choice([None, "GPU", "CPU", "dísk"]),
                rng.choice([None, "adapter"]), rng.choice([None, 0, 2])))
        elif kind < 0.9:
            events.append(BlockRemoved(tuple(rng.randrange(1 << 64) for _ in range(rng.randrange(0, 40))),
                                       rng.choice([None, "GPU", "CPU"]), rng.choice([None, 1])))
        else:
            events.append(AllBlocksCleared())
    return KVEventBatch(rng.choice([float(trial), trial + 0.25, 1.7e9]), tuple(events), rng.choice([None, 0, 3]))


def _vllm_032(batch: KVEventBatch, rng: random.Random) -> bytes:
    """vLLM 0.32's own wire shape (VLLM), with some of the fields vLLM 0.32 may add that the decoders
    ignore (kv_cache_spec_sliding_window, locality, ownership, session_id)."""
    doc = msgpack.unpackb(encode_batch(batch, VLLM), raw=False)
    for e in doc[1]:
        for k, v in (("kv_cache_spec_sliding_window", 4096), ("locality", "LOCAL"), ("ownership", None),
                     ("session_id", "s-1")):
            if e["type"] == "BlockStored" and rng.random() < 0.3:
                e[k] = v
    return msgpack.packb(doc, use_bin_type=True)


def _decoded(payload: bytes, accel, monkeypatch) -> KVEventBatch | str:
    """The batch, or the decoder's error; token ids a corrupt payload holds undecodable (msgspec
    skips them unchecked, see RawTokenIds) read as their error."""
    with monkeypatch.context() as m:
        m.setattr(codec, "_ACCEL", accel)
        try:
            batch = codec.decode_batch(payload)
        except KVEventDecodeError as exc:
            return f"error: {exc}"
    events = []
    for e in batch.events:
        if type(e) is BlockStored:
            try:
                e.token_ids.ids() if type(e.token_ids) is codec.RawTokenIds else None
            except KVEventDecodeError as exc:
                e = msgspec.structs.replace(e, token_ids=(str(exc),))
        events.append(e)
    return msgspec.structs.replace(batch, events=tuple(events))


def _corrupt(rng: random.Random, payload: bytes) -> bytes:
    b = bytearray(payload)
    op = rng.random()
    if op < 0.3:
        return bytes(b[: rng.randrange(len(b))])  # truncated
    if op < 0.4:
        return payload + bytes([rng.randrange(256)])  # trailing byte
    for _ in range(rng.randrange(1, 4)):
        b[rng.randrange(len(b))] = rng.choice([0xC0, 0xC2, 0xFF, 0x00, 0x7F, 0xCC, 0xCF, 0xD3, 0xDC, 0xDE, 0xA3,
                                               rng.randrange(256)])
    return bytes(b)


def test_c_kv_decoder_answers_as_the_python_decoders(c_speedups, monkeypatch):
    """Random batches in every wire shape (vLLM 0.32's array batch of map events, the map batch,
    the older all-array shape) and random corruptions of them: the batch decoded with the C
    decoder equals the pure-Python one, or both refuse with the same error. The C decoder takes the
    common shapes itself (not just stepping aside)."""
    rng = random.Random(77)
    taken = 0
    for trial in range(1500):
        batch = _random_batch(rng, trial)
        shape = trial % 3
        payload = _vllm_032(batch, rng) if shape == 0 else encode_batch(batch, CURRENT if shape == 1 else ARRAY)
        if trial % 2:
            payload = _corrupt(rng, payload)
        want = _decoded(payload, None, monkeypatch)
        got = _decoded(payload, c_speedups, monkeypatch)
        assert got == want, (trial, payload[:80])
        if not trial % 2:
            assert want == batch
        if (built := c_speedups.kv_batch(payload, codec._RECORDS)) is not None:
            taken += 1
            assert not isinstance(want, str)
            # the records built in C are those the Python decoders build, of the same types
            assert built == want
            assert [type(e) for e in built.events] == [type(e) for e in want.events]
            assert all(type(e.token_ids) is codec.RawTokenIds for e in built.events if type(e) is BlockStored)
            # merged as it decodes: what merge_removed makes of the unmerged batch
            assert c_speedups.kv_batch(payload, codec._RECORDS, True) == codec.merge_removed(want)
    assert taken > 400
    for bad in ((), codec._RECORDS[:4], [*codec._RECORDS]):
        with pytest.raises(TypeError, match="classes"):
            c_speedups.kv_batch(payload, bad)
    with pytest.raises(TypeError, match="classes"):
        c_speedups.kv_batch(payload)


def test_c_kv_decoder_leaves_token_ids_raw_and_odd_shapes_to_python(c_speedups, monkeypatch):
    monkeypatch.setattr(codec, "_ACCEL", c_speedups)
    toks = tuple(range(70_000))
    batch = codec.decode_batch(encode_batch(KVEventBatch(0.0, (BlockStored((1, 2), None, toks, 16),)), VLLM))
    ids = batch.events[0].token_ids
    assert type(ids) is codec.RawTokenIds and ids._ids is None and len(ids) == 70_000
    assert ids[:16] == toks[:16] and ids._ids is None and ids == toks
    # outside the C subset: non-int token ids, extra_keys, an unknown key, digest-bytes hashes
    stored = {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None, "token_ids": [1] * 16,
              "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}
    for odd in ({"token_ids": ["a", 2.5] * 8}, {"extra_keys": [None, ["salt"]]}, {"future_field": 1},
                {"locality": [1]},
                {"block_hashes": [b"\x00" * 31 + b"\x05"]}, {"block_hashes": [-1]}):
        payload = msgpack.packb([1.0, [{**stored, **odd}]])
        assert c_speedups.kv_batch(payload, codec._RECORDS) is None, odd
        assert codec.decode_batch(payload) == _decoded(payload, None, monkeypatch)


# ------------------------------------------------------------------------------ usage objects


def _random_usage(rng: random.Random) -> dict:
    u: dict = {}
    for k in rng.sample(["prompt_tokens", "total_tokens", "completion_tokens", "x_1"], rng.randint(0, 4)):
        u[k] = rng.choice([0, 7, rng.randrange(10**6), rng.randrange(10**17), None])
    if rng.random() < 0.8:
        u["prompt_tokens_details"] = rng.choice([None, {}, {"cached_tokens": rng.randrange(10**5)},
                                                 {"cached_tokens": None, "y": {"z": 1}}])
    return u


_USAGE_NOISE = [b" ", b"\n", b"-", b".5", b"e3", b'"s"', b"true", b"{", b"}", b",", b":", b"0", b"01",
                b"12345678901234567890", b'"usage"', b'\\"', b"[", b"]", b"\\u00e9"]


def test_c_usage_reader_answers_as_the_python_tail_reader(c_speedups):
    """vLLM-shaped JSON answers (random usage objects, spaced or compact), cut anywhere and with
    random noise spliced in: the C reader's usage object equals usage_from_tail's, or it answers
    None (and Python decides). It takes the common compact shape itself."""
    from gateway.http.usage import usage_from_tail

    rng = random.Random(19)
    taken = 0
    for trial in range(6000):
        doc = {"id": "cmpl-1", "choices": [{"text": rng.choice(["a", '} {"usage": {', "\\"])}],
               "usage": _random_usage(rng), "kv_transfer_params": rng.choice([None, {"k": "v"}])}
        tail = msgspec.json.encode(doc)
        if trial % 4 == 1:
            tail = tail.replace(b'":', b'" : ')
        elif trial % 4 == 2:
            cut = rng.randrange(len(tail) + 1)
            tail = tail[:cut] if rng.random() < 0.5 else tail[cut:]
        elif trial % 4 == 3:
            at = rng.randrange(len(tail) + 1)
            tail = tail[:at] + rng.choice(_USAGE_NOISE) + tail[at:]
        got = c_speedups.usage_object(tail)
        if trial % 4 == 0:
            assert got == doc["usage"], tail  # the compact shape vLLM sends: read in C
        if got is not None:
            taken += 1
            assert got == usage_from_tail(tail, sse=False), tail
    assert taken > 1500
    with pytest.raises(TypeError):
        c_speedups.usage_object("text")


# ------------------------------------------------------------------------------ text chunk hashes


def test_c_chunk_hashes_are_hashlib_blake2b(c_speedups, monkeypatch):
    """The C BLAKE2b chain against hashlib's, on random bytes and steps (one block, several, exactly
    128 bytes, the 8-byte chaining prefix crossing a block boundary), and text_chunk_hashes with and
    without the build on random text (non-ASCII and lone surrogates included)."""
    import hashlib

    def chain(data: bytes, step: int) -> list[int]:
        out, prev = [], b""
        for start in range(0, len(data) - step + 1, step):
            prev = hashlib.blake2b(prev + data[start : start + step], digest_size=8).digest()
            out.append(int.from_bytes(prev, "big"))
        return out

    rng = random.Random(23)
    for _ in range(2000):
        data = rng.randbytes(rng.randrange(0, 700))
        step = rng.choice([1, 7, 64, 119, 120, 121, 127, 128, 129, 248, 256, 300])
        assert c_speedups.chunk_hashes(data, step) == chain(data, step), (len(data), step)
    alphabet = "ab \n{}\u00e9\u4e2d\U0001f600\ud800"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 400)))
        step = rng.choice([1, 16, 64])
        monkeypatch.setattr(prompt, "_ACCEL", None)
        want = prompt.text_chunk_hashes(text, step)
        monkeypatch.setattr(prompt, "_ACCEL", c_speedups)
        assert prompt.text_chunk_hashes(text, step) == want
    for args, exc in (((b"ab", 0), ValueError), (("ab", 1), TypeError), ((b"ab",), TypeError)):
        with pytest.raises(exc):
            c_speedups.chunk_hashes(*args)


def test_a_build_from_another_source_is_refused(c_speedups, tmp_path):
    for k, source in enumerate(speedups.SOURCES):  # any source edited after the build
        changed = tmp_path / source.name
        changed.write_bytes(source.read_bytes() + b"\n/* edited after the build */\n")
        sources = [*speedups.SOURCES[:k], changed, *speedups.SOURCES[k + 1:]]
        with pytest.raises(ConfigError, match="built from another version of _speedups.c / _blockset.c / _sha256.c: run `make "
                                              "compile` again"):
            speedups.verified(c_speedups, sources)
    assert speedups.verified(c_speedups) is c_speedups


def test_runs_of_one_block_removals_merge_into_one_event_on_both_paths(c_speedups, monkeypatch):
    """vLLM sends a BlockRemoved per evicted block; merged, each run of one medium and group is one
    event with the hashes in order, a stored block or another medium ending the run."""
    stored = BlockStored((9,), None, tuple(range(16)), 16, medium="GPU", group_idx=0)
    events = (*(BlockRemoved((h,), "GPU", 0) for h in (1, 2, 3)), BlockRemoved((4,), "CPU", 0),
              BlockRemoved((5, 6), "CPU", 0), BlockRemoved((7,), "CPU", 1), stored, BlockRemoved((8,), "GPU", 0),
              AllBlocksCleared(), BlockRemoved((), "GPU", 0))
    want = (BlockRemoved((1, 2, 3), "GPU", 0), BlockRemoved((4, 5, 6), "CPU", 0), BlockRemoved((7,), "CPU", 1),
            stored, BlockRemoved((8,), "GPU", 0), AllBlocksCleared(), BlockRemoved((), "GPU", 0))
    batch = KVEventBatch(2.5, events, 0)
    assert codec.merge_removed(batch) == KVEventBatch(2.5, want, 0)
    payload = encode_batch(batch, VLLM)
    for accel in (None, c_speedups):
        monkeypatch.setattr(codec, "_ACCEL", accel)
        assert codec.decode_batch(payload) == batch  # unmerged unless asked
        assert codec.decode_batch(payload, merge=True) == KVEventBatch(2.5, want, 0)
    assert c_speedups.kv_batch(payload, codec._RECORDS, True) == KVEventBatch(2.5, want, 0)

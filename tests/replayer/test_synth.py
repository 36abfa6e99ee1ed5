"""Token synthesis: determinism, the prefix-identity property (hypothesis), memoized == direct hashes."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engines.hashing import BlockHasher
from gpuhit.errors import ConfigError
from replayer.loaders import bundled_path, load_trace
from replayer.synth import TokenSynthesizer
from replayer.trace import Session, Turn

E = 16
DIRECT = BlockHasher(E)


def _direct(synth: TokenSynthesizer, s: Session, k: int) -> tuple[int, ...]:
    return tuple(DIRECT.event_ints(synth.prompt_tokens(s, k)))


def _leading_common(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_tokens_deterministic_seeded_and_in_vocab():
    s = Session("s", (Turn(100, 1, (5, 6)),), 64, "ns")
    a = TokenSynthesizer(seed=1).prompt_tokens(s, 0)
    assert a == TokenSynthesizer(seed=1).prompt_tokens(s, 0)
    assert a != TokenSynthesizer(seed=2).prompt_tokens(s, 0)
    assert len(a) == 100 and all(0 <= t < 32000 for t in a)
    assert all(0 <= t < 1000 for t in TokenSynthesizer(vocab_size=1000).prompt_tokens(s, 0))
    # golden values: the mapping is part of the replay's reproducibility (a change alters every result)
    assert a[:4] == [20420, 19233, 5714, 705]


def test_block_tokens_depend_only_on_namespace_and_id():
    synth = TokenSynthesizer()
    x = Session("x", (Turn(128, 1, (7, 8)),), 64, "ns")
    y = Session("y", (Turn(100, 1, (7, 9)),), 64, "ns")
    z = Session("z", (Turn(128, 1, (7, 8)),), 64, "other")
    tx, ty, tz = (synth.prompt_tokens(s, 0) for s in (x, y, z))
    assert tx[:64] == ty[:64] and tx[64:100] != ty[64:]
    assert tx[:64] != tz[:64]


def test_uncovered_tail_is_unique_per_turn():
    # WEKA style: ids for full blocks only; the 10 trailing tokens are new text in every turn
    s = Session("s", (Turn(74, 1, (1,)), Turn(74, 1, (1,))), 64, "ns")
    synth = TokenSynthesizer()
    a, b = synth.prompt_tokens(s, 0), synth.prompt_tokens(s, 1)
    assert a[:64] == b[:64] and a[64:] != b[64:]
    assert synth.common_prefix_tokens(s, 0, s, 1) == 64
    assert synth.common_prefix_tokens(s, 0, s, 0) == 74


def test_system_prompt_shared_across_conversations_of_a_model():
    t = load_trace(
        [bundled_path("weka") / "trace_0004.json.gz", bundled_path("weka") / "trace_0020.json.gz"]
    ).trace
    a, b = (s for s in t.sessions if s.parent is None)
    assert a.model == b.model and (a.system_tokens, b.system_tokens) == (2979, 2927)
    on, off = TokenSynthesizer(), TokenSynthesizer(system_prompts=False)
    assert on.common_prefix_tokens(a, 0, b, 0) == 2927
    assert _leading_common(on.block_hashes(a, 0), on.block_hashes(b, 0)) == 2927 // E
    assert off.common_prefix_tokens(a, 0, b, 0) == 0
    assert _leading_common(off.block_hashes(a, 0), off.block_hashes(b, 0)) == 0
    # within a conversation the system prompt changes nothing: consecutive turns share their common ids
    assert on.common_prefix_tokens(a, 0, a, 1) == off.common_prefix_tokens(a, 0, a, 1) == 1317 * 64


def test_turn_of_another_model_gets_no_system_prompt():
    s = Session(
        "s",
        (Turn(300, 1, (1, 2, 3, 4, 5), model="opus"), Turn(300, 1, (9, 8, 7, 6, 5), model="haiku")),
        64,
        "ns",
        model="opus",
        system_tokens=100,
    )
    synth = TokenSynthesizer()
    assert synth.common_prefix_tokens(s, 0, s, 1) == 0
    assert synth.prompt_tokens(s, 0)[:100] != synth.prompt_tokens(s, 1)[:100]
    assert synth.block_hashes(s, 1) == _direct(synth, s, 1)


def test_memoized_equals_direct_on_bundled_sessions():
    t = load_trace(bundled_path("weka") / "trace_0276.json.gz").trace
    synth = TokenSynthesizer()
    for s in t.sessions[:2]:
        for k in range(min(4, len(s.turns))):
            assert synth.block_hashes(s, k) == _direct(synth, s, k)
    moon = load_trace(bundled_path("mooncake")).trace
    multi = [s for s in moon.sessions if len(s.turns) >= 3][:3]
    for s in multi:
        for k in range(len(s.turns)):
            assert synth.block_hashes(s, k) == _direct(synth, s, k)


def test_extension_hashes_only_new_blocks():
    ids = tuple(range(1, 41))
    s = Session("s", (Turn(20 * 64, 1, ids[:20]), Turn(40 * 64 + 5, 1, ids)), 64, "ns")
    synth = TokenSynthesizer()
    first = synth.block_hashes(s, 0)
    assert synth.hashed_blocks == 80 and len(first) == 80
    second = synth.block_hashes(s, 1)
    assert synth.hashed_blocks == 80 + 80  # 20 new trace blocks = 80 engine blocks; the 5-token tail has none
    assert second[:80] == first and second == _direct(synth, s, 1)
    assert synth.block_hashes(s, 1) == second and synth.hashed_blocks == 160  # warm: nothing hashed
    assert synth.cache_info()["nodes"] == 41
    synth.clear()
    assert synth.block_hashes(s, 1) == second and synth.hashed_blocks == 320


def test_resume_from_previous_turn_matches_direct_in_any_order():
    """The per-session resume point must give the trie walk's answer whatever the previous turn was:
    an extension, a divergence mid-way (compaction rewrites the history), a shorter turn, another
    model's turn (other root), or an interleaved session."""
    base = tuple(range(1, 31))
    turns = (
        Turn(20 * 64, 1, base[:20]),
        Turn(30 * 64 + 7, 1, base),  # extends turn 0
        Turn(25 * 64, 1, base[:12] + tuple(range(100, 113))),  # diverges at block 12
        Turn(10 * 64, 1, base[:10]),  # shorter than anything before
        Turn(30 * 64, 1, base, model="haiku"),  # another model: no system prompt, another root
        Turn(31 * 64, 1, base + (200,)),
    )
    s = Session("s", turns, 64, "ns", model="opus", system_tokens=100)
    other = Session("t", (Turn(30 * 64, 1, base), Turn(26 * 64, 1, base[:12] + tuple(range(100, 114)))), 64, "ns")
    for order in ([0, 1, 2, 3, 4, 5], [5, 3, 1, 0, 2, 4], [2, 2, 1, 4, 5, 0, 3]):
        synth = TokenSynthesizer()
        for j, k in enumerate(order):
            assert synth.block_hashes(s, k) == _direct(synth, s, k), (order, k)
            kk = j % 2  # interleave another session sharing the same ids
            assert synth.block_hashes(other, kk) == _direct(synth, other, kk)


def test_partial_last_block_is_not_memoized_under_the_full_key():
    # Mooncake style: the last id covers a partial block; a later turn with the same id and a longer
    # cut must hash that block's actual (longer) tokens
    s = Session("s", (Turn(520, 1, (0, 1)), Turn(1000, 1, (0, 1)), Turn(1024, 1, (0, 1))), 512, "ns")
    synth = TokenSynthesizer()
    for k in (0, 1, 2, 1, 0):
        assert synth.block_hashes(s, k) == _direct(synth, s, k)
    assert [len(synth.block_hashes(s, k)) for k in range(3)] == [32, 62, 64]


def test_straddling_engine_blocks_when_trace_block_is_not_a_multiple():
    s = Session(
        "s",
        (Turn(24 * 5, 1, (1, 2, 3, 4, 5)), Turn(24 * 3 + 7, 1, (1, 2, 3, 9))),
        24,
        "ns",
        model="m",
        system_tokens=30,
    )
    synth = TokenSynthesizer()
    for k in (0, 1, 0):
        assert synth.block_hashes(s, k) == _direct(synth, s, k)
    assert synth.num_blocks(24 * 5) == 7


def test_bad_parameters():
    with pytest.raises(ConfigError, match="vocab_size"):
        TokenSynthesizer(vocab_size=999)
    with pytest.raises(ConfigError, match="engine_block_size"):
        TokenSynthesizer(engine_block_size=0)
    with pytest.raises(ConfigError, match="unknown prefix-caching hash"):
        TokenSynthesizer(hash_name="md5")


# ---------------------------------------------------------------- the prefix-identity property

SYNTH = {flag: TokenSynthesizer(seed=3, system_prompts=flag) for flag in (False, True)}


@st.composite
def turn_pair(draw):
    bs = draw(st.sampled_from([16, 64, 512, 24]))
    base = draw(st.lists(st.integers(0, 50), min_size=1, max_size=6, unique=True))

    def turn(sid: str):
        n_common = draw(st.one_of(st.just(len(base)), st.integers(0, len(base))))
        extra = draw(st.lists(st.integers(100, 150), max_size=3, unique=True))
        ids = tuple(base[:n_common]) + tuple(extra)
        style = draw(st.sampled_from(["ceil", "floor", "none"]))
        if style == "none" or not ids:
            ids, length = (), draw(st.integers(0, 3 * bs))
        elif style == "ceil":
            length = (len(ids) - 1) * bs + draw(st.integers(1, bs))
        else:  # full-block ids plus an uncovered tail
            length = len(ids) * bs + draw(st.integers(0, bs - 1))
        system = draw(st.sampled_from([0, 0, 40, 40, 5, 200]))
        model = draw(st.sampled_from(["m1", "m1", "m1", "m2"]))
        namespace = draw(st.sampled_from(["ns", "ns", "ns", "other"]))
        turn_model = draw(st.sampled_from(["", model, model, "helper"]))
        return Session(
            sid, (Turn(length, 1, ids, model=turn_model),), bs, namespace, model=model, system_tokens=system
        )

    return turn("a"), turn("b"), bs


def _spec_common_tokens(a: Session, b: Session) -> int:
    """The trace-implied shared prefix without system prompts: min(c * bs, len_a, len_b)."""
    ta, tb = a.turns[0], b.turns[0]
    if a.namespace != b.namespace:
        return 0
    c = _leading_common(ta.hash_ids, tb.hash_ids)
    return min(c * a.block_size, ta.input_length, tb.input_length)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(turn_pair(), st.booleans())
def test_prefix_identity_property(pair, system_prompts):
    a, b, _bs = pair
    synth = SYNTH[system_prompts]
    ha, hb = synth.block_hashes(a, 0), synth.block_hashes(b, 0)
    assert ha == _direct(synth, a, 0) and hb == _direct(synth, b, 0)
    assert len(ha) == synth.num_blocks(a.turns[0].input_length)
    common = synth.common_prefix_tokens(a, 0, b, 0)
    ta, tb = synth.prompt_tokens(a, 0), synth.prompt_tokens(b, 0)
    assert ta[:common] == tb[:common]
    # exactly as many leading engine blocks as implied (an extra equal block would need independent
    # random tokens to collide: probability <= 1/32000, and the examples are derandomized)
    assert _leading_common(ha, hb) == common // E
    if not system_prompts:
        assert common == _spec_common_tokens(a, b)


# ---------------------------------------------------------------- the chain identity

def _same_equalities(pairs) -> None:
    """``pairs``: (vLLM hashes, chain ids) of prompts; equal hashes <=> equal ids, block by block."""
    v_to_c: dict[int, int] = {}
    c_to_v: dict[int, int] = {}
    for hv, hc in pairs:
        assert len(hv) == len(hc)
        for v, c in zip(hv, hc):
            assert v_to_c.setdefault(v, c) == c
            assert c_to_v.setdefault(c, v) == v


@st.composite
def chain_trace(draw):
    es = draw(st.sampled_from([16, 24, 64]))
    bs_of = {ns: draw(st.sampled_from([16, 64, 512, 24])) for ns in ("ns", "other")}
    sessions = []
    for i in range(draw(st.integers(1, 4))):
        ns = draw(st.sampled_from(["ns", "ns", "other"]))
        bs = bs_of[ns]
        base = draw(st.lists(st.integers(0, 12), max_size=6))
        model = draw(st.sampled_from(["m1", "m1", "m2"]))
        turns = []
        for _ in range(draw(st.integers(1, 3))):
            ids = tuple(base[: draw(st.integers(0, len(base)))]) + tuple(draw(st.lists(st.integers(0, 30), max_size=3)))
            style = draw(st.sampled_from(["ceil", "floor", "none"]))
            if style == "none" or not ids:
                ids, length = (), draw(st.integers(0, 3 * bs))
            elif style == "ceil":
                length = (len(ids) - 1) * bs + draw(st.integers(1, bs))
            else:
                length = len(ids) * bs + draw(st.integers(0, bs - 1))
            turns.append(Turn(length, 1, ids, model=draw(st.sampled_from(["", model, "helper"]))))
        system = draw(st.sampled_from([0, 5, 40, 200, 1000]))
        sessions.append(Session(f"s{i}", tuple(turns), bs, ns, model=model, system_tokens=system))
    keys = [(i, k) for i, s in enumerate(sessions) for k in range(len(s.turns))]
    order = draw(st.permutations(keys))
    return sessions, order + order[: draw(st.integers(0, len(order)))], es


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(chain_trace())
def test_chain_ids_have_the_equalities_of_vllm_hashes(case):
    """Across prompts of several sessions, namespaces, system prompts, partial trace blocks, tails and
    engine blocks that straddle trace blocks, in any order and repeated: two blocks have equal chain
    ids exactly when their vLLM hashes are equal (what every engine and index decision reads)."""
    sessions, order, es = case
    exact = TokenSynthesizer(seed=3, engine_block_size=es)
    cheap = TokenSynthesizer(seed=3, engine_block_size=es, identity="chain")
    _same_equalities((exact.block_hashes(sessions[i], k), cheap.block_hashes(sessions[i], k)) for i, k in order)


@pytest.mark.parametrize("es", [16, 48])
def test_chain_ids_on_the_bundled_slice(es):
    tr = load_trace(bundled_path("weka")).trace
    exact = TokenSynthesizer(seed=1, engine_block_size=es)
    cheap = TokenSynthesizer(seed=1, engine_block_size=es, identity="chain")
    turns = [(s, k) for s in tr.sessions[:12] for k in range(0, len(s.turns), 3)]
    _same_equalities((exact.block_hashes(s, k), cheap.block_hashes(s, k)) for s, k in turns)
    assert cheap.cache_info()["cached_blocks"] > 1000


def test_chain_identity_needs_one_block_size_per_namespace():
    synth = TokenSynthesizer(identity="chain")
    synth.block_hashes(Session("a", (Turn(64, 1, (1,)),), 64, "ns"), 0)
    with pytest.raises(ConfigError, match="one block size per namespace"):
        synth.block_hashes(Session("b", (Turn(64, 1, (1,)),), 16, "ns"), 0)
    with pytest.raises(ConfigError, match="identity"):
        TokenSynthesizer(identity="md5")


@pytest.mark.parametrize("identity", ["vllm", "chain"])
def test_a_turn_named_like_another_gets_its_own_ids(identity):
    """The synthesizer remembers each turn's trie walk (speed only); a turn of another trace with the
    same namespace, session id and index but other hash ids gets its own identities, before and
    after the first one is asked for again."""
    synth = TokenSynthesizer(identity=identity)
    first = Session("s", (Turn(64, 1, (1, 2, 3, 4)),), 16, "ns")
    other = Session("s", (Turn(64, 1, (1, 2, 7, 8)),), 16, "ns")
    a1 = list(synth.block_hashes(first, 0))
    b1 = list(synth.block_hashes(other, 0))
    a2 = list(synth.block_hashes(first, 0))
    b2 = list(synth.block_hashes(other, 0))
    assert a1 == a2 and b1 == b2 and len(a1) == len(b1) == 4
    assert a1[:2] == b1[:2] and a1[2] != b1[2] and a1[3] != b1[3]
    if identity == "vllm":  # exact hashes: what a fresh synthesizer gives
        assert b1 == list(TokenSynthesizer().block_hashes(other, 0))

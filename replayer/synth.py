"""Exact token synthesis: trace hash ids -> token ids -> vLLM block hashes, with memoized hashing.

Replayers that turn hash ids into *text* lose block identity on re-tokenization. gpuhit sends token
ids, so a prompt's engine blocks are equal exactly when the trace says its blocks are equal.

**Tokens.** A turn's prompt has ``input_length`` tokens; position ``p`` takes its token from

1. the session model's *system prompt* stream, if ``system_prompts`` is on, the session has
   ``system_tokens = S > 0``, the turn is of the session's model (or names none) and ``p < S``. The system prompt *replaces* the first S tokens (it is
   counted inside ``input_length``, as WEKA's ``in`` counts it). WEKA's first hash blocks already
   stand for that conversation's system prompt and tools, so within a session nothing changes;
   across conversations of the same model the first S tokens become identical, the real prefix
   that Claude Code requests share and that the locally scoped WEKA ids cannot express;
2. else the trace block ``p // B`` (``B`` = ``session.block_size``) while ``p // B < len(hash_ids)``:
   token ``p % B`` of the block that ``(namespace, hash id)`` maps to. A partial last block is
   simply cut: its tokens do not depend on the cut;
3. else (positions the ids do not cover: WEKA gives ids for full blocks only; Azure none) a *tail*
   stream unique to (namespace, session, turn): new text that nothing else shares.

Each stream is a counter-based generator keyed by the seed and the stream's identity
(:mod:`replayer.token_streams`), vectorized with numpy, no per-token Python objects.

**Identity property.** Two prompts share exactly their first :meth:`common_prefix_tokens` tokens
(the number their hash ids, system prompts and lengths imply), hence exactly
``common_prefix_tokens // engine_block_size`` leading engine blocks, whatever the trace block size,
up to an accidental collision of independent random tokens (probability <= ``1/vocab_size`` per
boundary block).

**Hashing.** :meth:`block_hashes` returns vLLM's event-int block hashes of the prompt, memoized in
a trie keyed by ``(parent node, next hash id)`` whose nodes hold the engine-block hashes that end
inside their trace block, so a turn that extends an earlier one hashes only its new blocks.
Only trace blocks that are full, covered by an id and inside the prompt are memoized; engine blocks
past them (a partial last trace block, the tail) depend on the cut and are hashed from the actual
tokens on every call.

**Identity.** ``identity="vllm"`` (the default) gives vLLM's exact hashes: what a live replay sends
and what the emulated HTTP server publishes, which real gateways check against vLLM's.
``identity="chain"`` is for virtual time, where the hashes go only to in-process engines and the
router, which compare them for equality and nothing else: each engine block gets a small integer,
fresh when its chain is first seen, so no block's tokens are synthesized or hashed. Two blocks get
the same id exactly when their token chains are equal by construction: a block wholly inside a
model's system prompt is that model's block ``j`` (shared across namespaces, as the tokens are);
any other block's chain holds namespace-scoped tokens, so it is the trie node's (root, hash-id
path) block, or, past the ids, the turn's own tail. vLLM's hashes would differ from this only where
independent random blocks collide (probability ``vocab_size ** -engine_block_size``) or sha256
does; equal-id structure, hence every decision and record, is the same (``tests/replayer/
test_records_pinned.py`` runs both). The ids are consecutive along a chain, which also makes the
engines' and the index's hash tables cheaper to probe than with scattered 64-bit hashes.
"""

from __future__ import annotations

from itertools import chain as iter_chain
from typing import Any

import numpy as np

from engines.hashing import BlockHasher, common_prefix_len
from engines.keyed_hashes import KeyedHashes
from gpuhit.errors import ConfigError
from replayer.chain_ids import ChainIds, IdArray
from replayer.token_streams import TokenStreams
from replayer.trace import Session

#: block identities: vLLM's exact hashes, or the simulator's chain ids (see the module docstring)
IDENTITIES = ("vllm", "chain")


class TokenSynthesizer:
    """Deterministic token ids and memoized vLLM block hashes for the turns of a trace."""

    def __init__(
        self,
        seed: int = 0,
        vocab_size: int = 32000,
        engine_block_size: int = 16,
        hash_name: str = "sha256",
        system_prompts: bool = True,
        identity: str = "vllm",
    ):
        if identity not in IDENTITIES:
            raise ConfigError(f"identity must be one of {', '.join(IDENTITIES)}, got {identity!r}")
        if type(vocab_size) is not int or vocab_size < 1000:
            raise ConfigError(f"vocab_size must be an integer >= 1000, got {vocab_size!r}")
        if type(engine_block_size) is not int or engine_block_size <= 0:
            raise ConfigError(f"engine_block_size must be a positive integer, got {engine_block_size!r}")
        self.seed = int(seed)
        self.vocab_size = vocab_size
        self.engine_block_size = engine_block_size
        self.system_prompts = system_prompts
        self.identity = identity
        self.hasher = BlockHasher(engine_block_size, hash_name)
        self._streams = TokenStreams(self.seed, vocab_size)
        # the memo trie: node ids index the parallel lists
        self._roots: dict[tuple, int] = {}
        self._children: dict[tuple[int, int], int] = {}
        # node n's identities are store[_node_start[n]:_node_end[n]]. vLLM's hashes: _store, a list
        # of int objects, not an array: every turn then hands out the *same* int objects for a
        # hash, so the engines' and the index's hash tables compare keys by identity (half the cost
        # of equal new ints). Chain ids: _keys, an int64 array, which turns go out as (KeyedHashes).
        self._node_start: list[int] = []
        self._node_end: list[int] = []
        self._node_digest: list[bytes | None] = []
        self._store: list[int] = []
        self.hashed_blocks = 0  # engine blocks actually hashed (for cost reports and tests)
        # Per-session resume point (speed only): the latest turn's memoized walk, so the next turn,
        # which extends it, starts where the two diverge instead of at the root. (namespace,
        # session id) -> (root key, hash ids walked, trie node after each of them (path[0] =
        # root), their engine-block identities: a tuple, or for chain ids the turn's int64 array).
        self._resume: dict[tuple[str, str], tuple[tuple, tuple[int, ...], list[int], Any]] = {}
        # (namespace, session id, turn index) -> (its hash ids, (the trace block its walk started at,
        # the trace blocks walked to, root key), the nodes it walked to, the store ranges they hold):
        # the walk of a turn asked for again
        self._walks: dict[tuple[tuple[str, str], int], tuple[tuple[int, ...], tuple, tuple[int, ...], tuple]] = {}
        self._chain_ids = ChainIds(engine_block_size)  # used with identity="chain" only
        self._keys = IdArray()

    # ---------------------------------------------------------------- tokens

    def num_blocks(self, prompt_len: int) -> int:
        """Full engine blocks of a prompt of ``prompt_len`` tokens (the ones vLLM can cache)."""
        return prompt_len // self.engine_block_size

    def _system_len(self, session: Session, turn_index: int) -> int:
        """S for this turn: the session's system prompt, unless off or the turn is another model's
        (a Haiku helper call inside an Opus conversation has its own, unknown, system prompt)."""
        if not self.system_prompts or session.system_tokens <= 0:
            return 0
        model = session.turns[turn_index].model
        return session.system_tokens if not model or not session.model or model == session.model else 0

    def _tokens_at(self, session: Session, turn_index: int, start: int, stop: int) -> np.ndarray:
        """Token ids (uint64) at prompt positions ``[start, stop)`` of the turn."""
        return self._streams.tokens_at(session, turn_index, start, stop, self._system_len(session, turn_index))

    def prompt_tokens(self, session: Session, turn_index: int) -> list[int]:
        """The turn's prompt as token ids (``input_length`` of them)."""
        n = session.turns[turn_index].input_length
        return self._tokens_at(session, turn_index, 0, n).tolist()

    def prompt_array(self, session: Session, turn_index: int) -> np.ndarray:
        """The prompt as a numpy uint64 array (no Python int per token)."""
        return self._tokens_at(session, turn_index, 0, session.turns[turn_index].input_length)

    def common_prefix_tokens(self, sa: Session, ta: int, sb: Session, tb: int) -> int:
        """How many leading tokens two turns' prompts share by construction (see the module doc)."""
        a, b = sa.turns[ta], sb.turns[tb]
        if sa.session_id == sb.session_id and sa.namespace == sb.namespace and ta == tb:
            return a.input_length  # the same turn
        limit = min(a.input_length, b.input_length)
        sys_a, sys_b = self._system_len(sa, ta), self._system_len(sb, tb)
        p = 0
        if sys_a or sys_b:
            if not (sys_a and sys_b and sa.model == sb.model):
                return 0
            p = min(sys_a, sys_b)
            if sys_a != sys_b or p >= limit:
                return min(p, limit)  # one system prompt ends where the other goes on
        # from p on, both prompts are in their block regions (or tails)
        if sa.namespace != sb.namespace or sa.block_size != sb.block_size:
            return min(p, limit)
        bs = sa.block_size
        cov_a = min(len(a.hash_ids) * bs, a.input_length)
        cov_b = min(len(b.hash_ids) * bs, b.input_length)
        k = p // bs
        ia, ib = a.hash_ids, b.hash_ids
        n = min(len(ia), len(ib))
        while k < n and ia[k] == ib[k]:
            k += 1
        same = k * bs  # equal block content up to here
        end = min(same, cov_a, cov_b)  # past it: different ids, or a tail (unique to its turn)
        return min(max(p, end), limit)

    # ---------------------------------------------------------------- hashes

    def block_hashes(self, session: Session, turn_index: int) -> tuple[int, ...] | KeyedHashes:
        """Identities of every full engine block of the turn's prompt (memoized).

        With ``identity="vllm"``: vLLM's event-int hashes, equal to
        ``BlockHasher(engine_block_size, hash_name).event_ints(prompt_tokens(...))``. With
        ``"chain"``: the chain ids of the module docstring, as a :class:`KeyedHashes` (one int64
        array). Cost: one dict probe per memoized trace block plus building the tuple (the
        array); new identities only for engine blocks not seen before and
        (vllm) for those past the last full, covered trace block.
        """
        turn = session.turns[turn_index]
        bs, es = session.block_size, self.engine_block_size
        n_in = turn.input_length
        ids = turn.hash_ids
        m = min(len(ids), n_in // bs)  # trace blocks that are full, covered by an id and in the prompt
        s_len = self._system_len(session, turn_index)
        root_key = (session.namespace, session.model if s_len else None, s_len, bs)
        node = self._roots.get(root_key)
        if node is None:
            node = self._new_node(0, 0, None)
            self._roots[root_key] = node
        # Resume from this session's previous walk where the ids agree: the trie maps equal id
        # prefixes to equal nodes, so the first c blocks' node and hashes are the recorded ones.
        chain = self.identity == "chain"
        if chain:
            self._chain_ids.check_namespace(session.namespace, bs)
        skey = (session.namespace, session.session_id)
        prev = self._resume.pop(skey, None)  # gone until this walk ends (it reuses the path)
        k = 0
        head: Any = ()  # the leading identities kept from the previous walk (a tuple, or chain: an array)
        path = [node]
        if prev is not None and prev[0] == root_key:
            _, p_ids, p_path, p_out = prev
            c = common_prefix_len(ids, p_ids, 0, m)
            if c:
                k = c
                node = p_path[c]
                path = p_path  # this walk replaces the previous one: its path is cut here and grown
                del path[c + 1 :]
                head = p_out[: (c * bs) // es]
        # Walk the memoized part, collecting the store ranges of its hashes; nodes created together
        # sit next to each other in the store, so a chain is usually a handful of ranges. A turn
        # walked before from the same resume point takes the nodes recorded then (the trie only
        # grows): every run of a seed asks for the same turns in the same order per session. The
        # very ids tuple must match (held by the record, so it cannot be another turn's: two traces
        # may name their sessions alike).
        children, starts, ends = self._children, self._node_start, self._node_end
        ranges: list[list[int]] = []
        last_end = -1
        add_path = path.append
        k0 = k
        wkey = (skey, turn_index)
        walked = self._walks.get(wkey)
        reuse = walked is not None and walked[0] is ids and walked[1] == (k0, m, root_key)
        if reuse:
            path.extend(walked[2])
            node = path[-1]
            ranges = [list(r) for r in walked[3]]
            k = m
        while k < m:
            child = children.get((node, ids[k]))
            if child is None:
                break
            node = child
            add_path(child)
            lo, hi = starts[child], ends[child]
            if lo == last_end:
                ranges[-1][1] = hi
            elif lo < hi:
                ranges.append([lo, hi])
            last_end = hi if lo < hi else last_end
            k += 1
        digest = self._node_digest[node]
        if k < m:
            # cold part: identities of the engine blocks of trace blocks k..m-1, recorded as nodes
            done = (k * bs) // es  # engine blocks complete before trace block k
            stop = (m * bs) // es
            first = self._stored()
            if chain:
                new, digests = self._fresh_ids(done, stop, session.model, s_len), None
            else:
                new, digests = self._sha_ids(session, turn_index, digest, done, stop)
            j = done
            for kk in range(k, m):
                end_j = ((kk + 1) * bs) // es
                if digests is not None and end_j > j:
                    digest = digests[end_j - done - 1]
                child = self._new_node(first + j - done, first + end_j - done, digest)
                children[(node, ids[kk])] = child
                node = child
                add_path(child)
                j = end_j
            self._store_ids(new)
            if new:
                if first == last_end:
                    ranges[-1][1] = first + len(new)
                else:
                    ranges.append([first, first + len(new)])
        if k0 < m and not reuse:
            self._walks[wkey] = (ids, (k0, m, root_key), tuple(path[k0 + 1 :]), tuple(tuple(r) for r in ranges))
        # uncached remainder: engine blocks that reach past the last memoizable trace block
        done = (m * bs) // es
        total = n_in // es
        if chain:
            # one int64 array: the kept part of the previous turn's, the store's ranges, the remainder
            parts = [head] if len(head) else []
            parts += [self._keys.view(lo, hi) for lo, hi in ranges]
            if done < total:
                parts.append(self._chain_remainder(session, turn_index, node, m, done, total, s_len))
            out = KeyedHashes(np.concatenate(parts) if parts else np.empty(0, np.int64))
            self._resume[skey] = (root_key, ids[:m], path, out.array)
            return out
        store = self._store
        if ranges:
            head += tuple(iter_chain.from_iterable(store[lo:hi] for lo, hi in ranges))
        self._resume[skey] = (root_key, ids[:m], path, head)
        if done >= total:
            return head
        new, _ = self._sha_ids(session, turn_index, digest, done, total)
        return head + tuple(new)

    def _sha_ids(self, session: Session, turn_index: int, parent: bytes | None, lo: int,
                 hi: int) -> tuple[list[int], list[bytes]]:
        """vLLM's event ints (and digests) of engine blocks ``lo..hi-1``, chained on ``parent``."""
        es = self.engine_block_size
        hash_fn, root, extra = self.hasher.hash_fn, self.hasher.root, self.hasher.extra_keys
        tokens = self._tokens_at(session, turn_index, lo * es, hi * es).tolist()
        ints: list[int] = []
        digests: list[bytes] = []
        digest = parent
        for off in range(0, len(tokens), es):
            digest = hash_fn((digest or root, tuple(tokens[off : off + es]), extra))
            digests.append(digest)
            ints.append(int.from_bytes(digest[-8:], "big"))  # = to_event_int
        self.hashed_blocks += hi - lo
        return ints, digests

    def _fresh_ids(self, lo: int, hi: int, model: str, s_len: int) -> list[int]:
        self.hashed_blocks += hi - lo
        return self._chain_ids.fresh(lo, hi, model, s_len)

    def _chain_remainder(self, session: Session, turn_index: int, node: int, m: int, done: int, total: int,
                         s_len: int) -> np.ndarray:
        """Chain ids of engine blocks ``done..total-1``, past the last full, covered trace block ``m-1``.

        If the prompt ends inside trace block ``m`` (an id covers it), those blocks hold that trace
        block's leading tokens, exactly as the full block's first engine blocks: they are read off
        (or recorded as) the trie node of ``(node, id m)``. Otherwise they reach into the turn's own
        tail, which nothing else shares: ids of their own, kept per turn.
        """
        ids = session.turns[turn_index].hash_ids
        if m < len(ids):
            child = self._children.get((node, ids[m]))
            if child is None:
                bs, es = session.block_size, self.engine_block_size
                lo = self._stored()
                self._store_ids(self._fresh_ids(done, ((m + 1) * bs) // es, session.model, s_len))
                child = self._new_node(lo, self._stored(), None)
                self._children[(node, ids[m])] = child
            lo = self._node_start[child]
            return self._keys.view(lo, lo + total - done)
        before = self._chain_ids.issued
        tail = self._chain_ids.tail((session.namespace, session.session_id, turn_index), done, total, session.model,
                                    s_len)
        self.hashed_blocks += self._chain_ids.issued - before  # new ids only: a turn asked again costs none
        return tail

    def _stored(self) -> int:
        """Identities in the store (the next node's start)."""
        return self._keys.n if self.identity == "chain" else len(self._store)

    def _store_ids(self, new: list[int]) -> None:
        """Append identities to the store: chain ids to the int64 array only (no Python int kept per
        block), vLLM's hashes to the list of their int objects."""
        if self.identity == "chain":
            self._keys.extend(new)
        else:
            self._store.extend(new)

    def _new_node(self, start: int, end: int, digest: bytes | None) -> int:
        """A trie node whose engine-block hashes are ``_store[start:end]``."""
        self._node_start.append(start)
        self._node_end.append(end)
        self._node_digest.append(digest)
        return len(self._node_end) - 1

    def cache_info(self) -> dict[str, int]:
        """Memo size: trie nodes and the engine-block hashes they hold; blocks hashed so far."""
        return {"nodes": len(self._node_end), "cached_blocks": self._stored(), "hashed_blocks": self.hashed_blocks}

    def clear(self) -> None:
        """Drop the memo (a long sweep over many traces can bound its memory this way)."""
        self._roots.clear()
        self._children.clear()
        self._node_start.clear()
        self._node_end.clear()
        self._node_digest.clear()
        self._store.clear()
        self._keys.clear()
        self._resume.clear()
        self._walks.clear()
        self._chain_ids.clear()

"""Check, from the engines' own KV events, that the gateway hashes blocks exactly as they do.

The precise index matches a request's block hashes against the hashes the engines publish. If the
gateway's hash algorithm, ``NONE_HASH`` seed (vLLM derives it from ``PYTHONHASHSEED``) or block size
differ from an engine's, nothing ever matches: every predicted hit is 0 and a cache-aware policy
silently degrades to load balancing. So every ``BlockStored`` event that starts a chain
(``parent_block_hash`` None: its first block's parent is ``NONE_HASH``) and carries no extra hash keys
(LoRA, multimodal, cache_salt) is a candidate: its block size is compared with the gateway's, and
its first block is re-hashed from its ``token_ids`` and compared with the hash the engine published.
A wrong configuration makes *every* chain mismatch, so re-hashing each engine's first
``CHECK_FIRST`` chain starts and then one in ``CHECK_EVERY`` detects it as surely as re-hashing all of
them (and an engine restarted with another seed within ``CHECK_EVERY`` chains), at a fraction of the
cost: with a new prompt per request the re-hash was about 5% of the gateway's CPU. A mismatch is said
loudly: one warning per engine in the log, ``gpuhit_gateway_kv_hash_checks_total{instance,
outcome="mismatch"}`` in ``/metrics``, and ``hash_check`` in ``/debug/state``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from engines.hash_functions import to_event_int
from engines.hashing import BlockHasher
from engines.kv_events import BlockStored, KVEventBatch, KVEventDecodeError

log = logging.getLogger(__name__)

CHECK_FIRST = 64  # chain starts re-hashed per engine before sampling begins
CHECK_EVERY = 64  # then one chain start in this many

MATCH = "match"
MISMATCH = "mismatch"
BLOCK_SIZE_MISMATCH = "block_size_mismatch"


@dataclass(slots=True)
class EngineHashCheck:
    """Running totals for one engine."""

    chain_starts: int = 0  # candidates seen (each block-size checked; the first and then a sample re-hashed)
    checked: int = 0
    mismatches: int = 0
    block_size_mismatches: int = 0
    last_mismatch: str | None = None
    warned: bool = False

    def as_dict(self) -> dict[str, Any]:
        ok = None if self.checked == 0 and self.block_size_mismatches == 0 else (
            self.mismatches == 0 and self.block_size_mismatches == 0)
        return {"chain_starts": self.chain_starts, "checked": self.checked, "mismatches": self.mismatches,
                "block_size_mismatches": self.block_size_mismatches, "ok": ok, "last_mismatch": self.last_mismatch}


class HashVerifier:
    """Re-hashes chain-start ``BlockStored`` events of each engine (see the module docstring)."""

    def __init__(self, hasher: BlockHasher, names: Sequence[str]):
        self.hasher = hasher
        self.names = tuple(names)
        self.engines = [EngineHashCheck() for _ in names]

    def callback(self, i: int) -> Callable[[KVEventBatch], None]:
        """The KV-event callback for engine ``i``."""

        def on_batch(batch: KVEventBatch) -> None:
            self.observe(i, batch)

        return on_batch

    def observe(self, i: int, batch: KVEventBatch) -> None:
        for ev in batch.events:
            if type(ev) is BlockStored and ev.parent_block_hash is None and ev.block_hashes:
                self._check(i, ev)

    def _check(self, i: int, ev: BlockStored) -> None:
        st = self.engines[i]
        bs = self.hasher.block_size
        if ev.block_size != bs:
            st.block_size_mismatches += 1
            self._warn(i, f"its KV events use block size {ev.block_size}, the gateway {bs}: start the gateway "
                          f"with --block-size {ev.block_size} (or leave it unset to read it from the engines)")
            return
        if (ev.extra_keys is not None and ev.extra_keys[0] is not None) or ev.lora_name:
            return  # not reproducible from tokens alone
        st.chain_starts += 1
        if st.chain_starts > CHECK_FIRST and st.chain_starts % CHECK_EVERY:
            return  # sampled (see the module docstring)
        # Only now the token ids' length: the lazy ids read it from their bytes, ~40 bytecodes a
        # chain start that sampling mostly skips.
        if len(ev.token_ids) < bs:
            return  # fewer tokens than a block: nothing to re-hash (vLLM stores only full blocks)
        try:
            first = ev.token_ids[:bs]
        except KVEventDecodeError as exc:  # a corrupt payload msgspec let through: the hash is unverifiable
            self._warn(i, f"a chain-start block's token ids do not decode ({exc})")
            return
        st.checked += 1
        got = to_event_int(self.hasher.hash_block(None, first))
        if got != ev.block_hashes[0]:
            st.mismatches += 1
            h = self.hasher
            self._warn(i, f"a chain-start block it published hashes to {ev.block_hashes[0]}, the gateway computes "
                          f"{got} (gateway: --hash {h.hash_name}, NONE_HASH seed {h.seed!r}); every predicted "
                          f"hit on it will be 0. Give the gateway the engines' --prefix-caching-hash-algo "
                          f"(--hash) and PYTHONHASHSEED (--hash-seed)")

    def _warn(self, i: int, detail: str) -> None:
        st = self.engines[i]
        st.last_mismatch = detail
        if not st.warned:
            st.warned = True
            log.warning("KV hash mismatch with engine %s: %s", self.names[i], detail)

    def state(self) -> list[dict[str, Any]]:
        return [st.as_dict() for st in self.engines]

    def render(self) -> Iterable[Any]:
        """``gpuhit_gateway_kv_hash_checks_total{instance, outcome}``: one prometheus_client counter
        family, collected with the gateway's other metrics at scrape time."""
        from prometheus_client.core import CounterMetricFamily

        fam = CounterMetricFamily(
            "gpuhit_gateway_kv_hash_checks",
            "Chain-start blocks from the engines' KV events re-hashed by the gateway, by outcome (mismatch: "
            "the gateway's hash algorithm, seed or block size differs from the engine's).",
            labels=("instance", "outcome"))
        for n, st in zip(self.names, self.engines):
            fam.add_metric([n, MATCH], st.checked - st.mismatches)
            fam.add_metric([n, MISMATCH], st.mismatches)
            fam.add_metric([n, BLOCK_SIZE_MISMATCH], st.block_size_mismatches)
        yield fam

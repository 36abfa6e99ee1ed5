"""What the gateway learns from its engines as it starts: their KV block size, the longest prompt
they take, the model cards ``/v1/models`` merges, and the tokenizer their cards point to.

The gateway serves what the engines serve, so it asks them instead of being told: a block size
given with ``--block-size`` must agree with what they report, or every predicted hit would be
wrong. Kept apart from :mod:`gateway.http.app`, which wires the parts once these facts are known.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from engines.vllm.client import VLLMEngine
from gateway.tokenizer import PromptTokenizer, discover
from gpuhit.errors import ConfigError, EngineError, GpuhitError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FirstScrape:
    """What the first look at one engine found beside its metrics: its card's ``max_model_len``,
    its model cards (the gateway's ``/v1/models`` merges every engine's) and its card's ``root``
    (where its tokenizer lives)."""

    max_model_len: int | None
    cards: tuple[dict[str, Any], ...]
    root: str | None


async def first_scrape(eng: VLLMEngine, probe: aiohttp.ClientSession) -> FirstScrape:
    """Metrics (stats, block size) and the model card of ``eng``; an engine whose ``/metrics`` does
    not answer is an :class:`EngineError`, a missing or odd card leaves its fields None."""
    try:
        await eng.scraper.scrape_once()
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise EngineError(f"engine {eng.name} at {eng.base_url}: /metrics not reachable: {exc}") from None
    mm = root = None
    kept: tuple[dict[str, Any], ...] = ()
    try:
        async with probe.get(eng.base_url + "/v1/models") as r:
            cards = (await r.json(content_type=None))["data"]
            card = cards[0]
            mm, root = card.get("max_model_len"), card.get("root")
            kept = tuple(c for c in cards if isinstance(c, dict) and isinstance(c.get("id"), str))
    except (aiohttp.ClientError, KeyError, IndexError, TypeError, ValueError):
        pass
    return FirstScrape(mm if isinstance(mm, int) else None, kept, root if isinstance(root, str) else None)


def agreed_block_size(engines: Sequence[VLLMEngine], want: int | None) -> int:
    """The block size hashes are cut at: the engines' (``vllm:cache_config_info``), which must agree
    with each other and with ``--block-size`` (``want``) when that is given."""
    reported = {e.name: e.stats().block_size for e in engines if e.stats().block_size}
    sizes = set(reported.values())
    if len(sizes) > 1:
        raise ConfigError(f"the engines report different KV block sizes {reported}; one gateway needs one size")
    if want and sizes and want not in sizes:
        raise ConfigError(f"--block-size {want} but the engines report block size {sizes.pop()} "
                          f"(vllm:cache_config_info): every predicted hit would be wrong")
    size = want or (sizes.pop() if sizes else None)
    if size is None:
        raise ConfigError("the engines do not report their KV block size (no vllm:cache_config_info in /metrics): "
                          "give --block-size")
    return size


def discovered_tokenizer(roots: Sequence[str | None]) -> PromptTokenizer | None:
    """The engines' own tokenizer (their model cards' ``root`` folders), when one is found and
    usable; else None (text and chat prompts are then routed by an approximate hash)."""
    found = discover(roots)
    if found is None:
        return None
    try:
        tok = PromptTokenizer(found)
    except GpuhitError as exc:
        log.warning("the engines' tokenizer at %s is not usable (%s): text and chat prompts are routed by "
                    "an approximate hash", found, exc)
        return None
    log.info("text and chat prompts tokenized with the engines' tokenizer at %s", found)
    return tok


__all__ = ["FirstScrape", "agreed_block_size", "discovered_tokenizer", "first_scrape"]

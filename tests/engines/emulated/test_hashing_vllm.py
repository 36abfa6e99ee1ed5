"""The engine's KV events carry vLLM's exact block hashes (reference vector from vLLM's own code)."""

import os

import pytest

from engines.base import GenerateRequest
from engines.emulated.engine import EmulatedEngine
from gpuhit import vtime

from .conftest import tiny_profile


@pytest.mark.skipif("PYTHONHASHSEED" in os.environ, reason="vLLM's NONE_HASH depends on PYTHONHASHSEED")
def test_block_stored_carries_vllm_hashes_and_tokens():
    tokens = list(range(1000, 1032))
    events = []

    async def main():
        e = EmulatedEngine("e", tiny_profile(block_size=16, max_num_batched_tokens=64))
        e.subscribe_kv_events(events.append)
        res = await e.generate(GenerateRequest("r", 32, 1, prompt_token_ids=tokens))
        await e.close()
        return res

    res = vtime.run(main())
    assert res.ok
    stored = [ev for b in events for ev in b.events]
    assert len(stored) == 1
    ev = stored[0]
    assert ev.block_hashes == (7322446309363477352, 17027874615116373601)
    assert ev.parent_block_hash is None and ev.token_ids == tuple(tokens) and ev.block_size == 16
    assert ev.medium == "GPU"

"""replayer.calibrate's probe grids: decode probes reach the contexts real prompts reach, within the pool."""

from __future__ import annotations

from replayer.calibrate import decode_grid


def test_decode_grid_spans_short_to_the_longest_context_each_batch_fits():
    grid = decode_grid([1, 4, 8], max_model_len=2048, pool_tokens=255 * 32, block_size=32, tokens=32)
    assert grid == [(1, 64), (1, 1004), (1, 2008), (4, 64), (4, 988), (4, 1976), (8, 64), (8, 478), (8, 956)]
    for b, c in grid:
        assert c + 32 <= 2048 - 8 and b * (c + 32) <= 255 * 32  # one request fits the model, the batch the pool


def test_a_pool_too_small_for_long_contexts_keeps_the_two_block_floor():
    assert decode_grid([8], max_model_len=4096, pool_tokens=8 * 100, block_size=32, tokens=32) == [(8, 64)]

"""Exact online-softmax merge of partials ``(o, m, l)`` (Milakov & Gimelshein 2018; *Move the Query, Not the Cache*).

For partials ``i`` over disjoint KV subsets of the same query rows, with ``M = max_i m_i`` and weights
``w_i = l_i * exp(m_i - M)``, the full attention output is ``sum_i w_i o_i / sum_i w_i`` (``o_i``
normalized). The merged statistic is ``(o, M, sum_i w_i)``, itself a partial, so merges nest (a tree
of holders merges the same as a flat list). Properties the tests pin down:

- commutative and associative up to float round-off (it is a weighted mean);
- the zero-weight identity: a partial with ``m = -inf, l = 0`` (an empty chunk) contributes nothing
  and produces no NaN; if every partial is empty the result is ``(0, -inf, 0)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engines.attention._torch import require_torch
from engines.attention.partial import Partial
from gpuhit.errors import BadRequestError


def merge_partial_stats(partials: Sequence[Partial | tuple[Any, Any, Any]]) -> Partial:
    """Merge partials into one :class:`Partial` (float32), usable as input to a further merge."""
    torch = require_torch()
    if not partials:
        raise BadRequestError("merge_partials needs at least one partial")
    parts = [p if isinstance(p, Partial) else Partial(*p) for p in partials]
    shape = tuple(parts[0].o.shape)
    for p in parts:
        if tuple(p.o.shape) != shape or tuple(p.m.shape) != shape[:2] or tuple(p.l.shape) != shape[:2]:
            raise BadRequestError(
                f"partials disagree on shape: o {tuple(p.o.shape)}, m {tuple(p.m.shape)}, l {tuple(p.l.shape)} vs o {shape}"
            )
    if len(parts) == 1:
        p = parts[0]
        return Partial(p.o.float(), p.m.float(), p.l.float())
    m = torch.stack([p.m.float() for p in parts])  # [P, Mq, Hq]
    l = torch.stack([p.l.float() for p in parts])
    big_m = m.amax(dim=0)
    m_ref = torch.where(torch.isinf(big_m), torch.zeros_like(big_m), big_m)
    # exp(-inf - finite) = 0: an empty partial's weight vanishes without a NaN.
    w = l * torch.exp(m - m_ref)
    total = w.sum(dim=0)
    o = torch.stack([p.o.float() for p in parts])
    num = (w[..., None] * o).sum(dim=0)
    o_merged = num / torch.where(total > 0, total, torch.ones_like(total))[..., None]
    return Partial(o_merged, big_m, total)


def merge_partials(partials: Sequence[Partial | tuple[Any, Any, Any]]) -> Any:
    """Merge partials into the final normalized attention output ``[Mq, Hq, d_v]`` (float32)."""
    return merge_partial_stats(partials).o

"""Partial attention of query rows over a resident KV subset, returning ``(o, m, l)``.

Layout (token-major, as a paged cache stores it):

- ``q``: ``[Mq, Hq, d_qk]`` query rows (already rotated to their positions),
- ``k``: ``[N, Hkv, d_qk]``, ``v``: ``[N, Hkv, d_v]`` the holder's resident chunk, ``Hq % Hkv == 0``;
  query head ``h`` reads KV head ``h // (Hq // Hkv)`` (the usual GQA grouping). Absorbed MLA is the
  case ``Hkv == 1``, ``v = k[..., :d_v]`` (see :func:`mla_kv`).

The result is a :class:`Partial` with

- ``o``: ``[Mq, Hq, d_v]`` float32, **normalized** (``sum_j p_j v_j / l``), the convention of
  FlashAttention's tile output: bounded by the values' range, so it survives a bf16 wire;
- ``m``: ``[Mq, Hq]`` float32 row max of the scaled logits over the *attended* keys (``-inf`` if none);
- ``l``: ``[Mq, Hq]`` float32 row sum of ``exp(s - m)`` (``0`` if none).

A row that attends nothing (an empty chunk, or every key masked) is the merge identity
``(0, -inf, 0)``: it carries zero weight and never produces a NaN.

Precision: the default ``upcast=True`` computes logits and the weighted sum in float32 whatever the
input dtype (exact reference, and what "accumulate in fp32" means here). ``upcast=False`` runs both
matmuls in the input dtype (cuBLAS/oneDNN still accumulate in fp32 but round the logits to the input
dtype); it exists so the GPU benchmark can time the cheaper path a fused kernel approximates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engines.attention._torch import require_torch
from gpuhit.errors import BadRequestError


@dataclass(frozen=True, slots=True)
class Partial:
    """One holder's sufficient statistic for a set of query rows: see the module docstring."""

    o: Any
    m: Any
    l: Any

    @property
    def rows(self) -> int:
        return int(self.o.shape[0])


def mla_kv(latent: Any, d_v: int = 512) -> tuple[Any, Any]:
    """Absorbed-MLA K and V from the cached latent ``[N, d_qk]`` or ``[N, 1, d_qk]`` (views, no copy)."""
    if latent.dim() == 2:
        latent = latent.unsqueeze(1)
    if latent.dim() != 3 or latent.shape[1] != 1 or latent.shape[2] < d_v:
        raise BadRequestError(f"MLA latent must be [N, d_qk] or [N, 1, d_qk] with d_qk >= {d_v}, got {tuple(latent.shape)}")
    return latent, latent[..., :d_v]


def causal_mask(q_positions: Any, k_positions: Any) -> Any:
    """Boolean ``[Mq, N]`` mask, True where key position <= query position (the key is visible)."""
    torch = require_torch()
    qp = torch.as_tensor(q_positions).reshape(-1, 1)
    kp = torch.as_tensor(k_positions, device=qp.device).reshape(1, -1)
    return kp <= qp


def empty_partial(rows: int, n_q_heads: int, d_v: int, *, device: Any = None) -> Partial:
    """The zero-weight identity for ``rows`` query rows: ``o = 0, m = -inf, l = 0``."""
    torch = require_torch()
    return Partial(
        o=torch.zeros(rows, n_q_heads, d_v, dtype=torch.float32, device=device),
        m=torch.full((rows, n_q_heads), float("-inf"), dtype=torch.float32, device=device),
        l=torch.zeros(rows, n_q_heads, dtype=torch.float32, device=device),
    )


def _check(q: Any, k: Any, v: Any, mask: Any) -> tuple[int, int, int, int, int, int]:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise BadRequestError(
            f"partial_attention wants q [Mq,Hq,d_qk], k [N,Hkv,d_qk], v [N,Hkv,d_v]; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    mq, hq, dqk = q.shape
    n, hkv, dk = k.shape
    if dk != dqk:
        raise BadRequestError(f"q and k widths differ: {dqk} vs {dk}")
    if v.shape[0] != n or v.shape[1] != hkv:
        raise BadRequestError(f"k {tuple(k.shape)} and v {tuple(v.shape)} disagree on tokens or KV heads")
    if hkv == 0 or hq % hkv:
        raise BadRequestError(f"{hq} query heads cannot be grouped over {hkv} KV heads")
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise BadRequestError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if mask is not None and tuple(mask.shape) not in ((mq, n), (mq, hq, n)):
        raise BadRequestError(f"mask must be [Mq, N] or [Mq, Hq, N] = {(mq, n)} / {(mq, hq, n)}, got {tuple(mask.shape)}")
    return mq, hq, dqk, n, hkv, v.shape[2]


def partial_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    scale: float,
    mask: Any = None,
    q_positions: Any = None,
    k_positions: Any = None,
    upcast: bool = True,
) -> Partial:
    """Attention of ``q`` over the resident ``(k, v)`` as a mergeable :class:`Partial`.

    ``mask`` (bool, True = attend) is ``[Mq, N]`` or ``[Mq, Hq, N]``. ``q_positions``/``k_positions``
    (integer sequences) add causal masking: key ``j`` is visible to row ``i`` iff
    ``k_positions[j] <= q_positions[i]``; both masks combine with AND. ``scale`` multiplies the logits
    (``1/sqrt(d)`` for GQA; MLA uses ``1/sqrt(qk_nope + qk_rope)`` = ``1/sqrt(192)``, not of 576).
    """
    torch = require_torch()
    mq, hq, dqk, n, hkv, dv = _check(q, k, v, mask)
    if (q_positions is None) != (k_positions is None):
        raise BadRequestError("causal masking needs both q_positions and k_positions")
    if q_positions is not None:
        cm = causal_mask(torch.as_tensor(q_positions, device=q.device), torch.as_tensor(k_positions, device=q.device))
        if tuple(cm.shape) != (mq, n):
            raise BadRequestError(f"q_positions/k_positions must have {mq} and {n} entries, got mask {tuple(cm.shape)}")
        mask = cm if mask is None else (mask & (cm if mask.dim() == 2 else cm[:, None, :]))
    if n == 0 or mq == 0:
        return empty_partial(mq, hq, dv, device=q.device)

    g = hq // hkv
    cdt = torch.float32 if upcast else q.dtype
    # [Mq, Hkv, G, d] -> [Hkv, Mq*G, d]: one batched matmul per KV head covers all its query heads.
    qg = q.reshape(mq, hkv, g, dqk).permute(1, 0, 2, 3).reshape(hkv, mq * g, dqk).to(cdt)
    kt = k.permute(1, 2, 0).to(cdt)  # [Hkv, d, N]
    s = torch.matmul(qg, kt).float().mul_(scale).view(hkv, mq, g, n)
    if mask is not None:
        mb = mask.to(device=s.device, dtype=torch.bool)
        mb = mb[None, :, None, :] if mb.dim() == 2 else mb.reshape(mq, hkv, g, n).permute(1, 0, 2, 3)
        s = s.masked_fill(~mb, float("-inf"))
    m = s.amax(dim=-1)  # [Hkv, Mq, G]
    # A fully masked row has m = -inf; subtract 0 there instead so exp(-inf - 0) = 0, not NaN.
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m_safe[..., None])
    l = p.sum(dim=-1)
    vv = v.permute(1, 0, 2).to(cdt)  # [Hkv, N, d_v]
    o = torch.matmul(p.to(cdt).view(hkv, mq * g, n), vv).float().view(hkv, mq, g, dv)
    o = o / torch.where(l > 0, l, torch.ones_like(l))[..., None]
    return Partial(
        o=o.permute(1, 0, 2, 3).reshape(mq, hq, dv),
        m=m.permute(1, 0, 2).reshape(mq, hq),
        l=l.permute(1, 0, 2).reshape(mq, hq),
    )


def reference_attention(q: Any, k: Any, v: Any, *, scale: float, mask: Any = None) -> Any:
    """Plain softmax attention in float64 over the whole KV (the single-instance ground truth).

    Rows that see no key return 0 (the same convention as an all-empty merge).
    """
    torch = require_torch()
    _, hq, _, _, hkv, _ = _check(q, k, v, mask)
    g = hq // hkv
    kk = k.double().repeat_interleave(g, dim=1)  # [N, Hq, d]
    vv = v.double().repeat_interleave(g, dim=1)
    s = torch.einsum("mhd,nhd->mhn", q.double(), kk) * scale
    if mask is not None:
        mb = mask.to(torch.bool)
        s = s.masked_fill(~(mb[:, None, :] if mb.dim() == 2 else mb), float("-inf"))
    w = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("mhn,nhd->mhd", w, vv)

#!/usr/bin/env python3
# ruff: noqa: B023 - every closure here is timed inside the loop iteration that defines it
"""One script that measures the attention primitives and transports on a lent GPU, and writes one JSON.

Run from the repository root::

    PYTHONPATH=. python3 tests/perf/gpu_measure.py --out $OUT            # full (~3-5 min on an H100)
    PYTHONPATH=. python3 tests/perf/gpu_measure.py --out $OUT --smoke    # tiny configuration, seconds
    PYTHONPATH=. python3 tests/perf/gpu_measure.py --crossover-from m.json --out DIR   # CPU: redo (d)

Sections (each in its own try/except; a failure is recorded in the JSON, the rest still runs):

(a) ``partial``: partial attention (o, m, l) and the merge versus query rows and chunk size, for
    absorbed MLA (d_qk 576, d_v 512, 16 and 128 heads) and GQA (32 q / 8 kv heads, d 128), bf16.
    Three implementations: ``ref`` (engines.attention.partial_attention, fp32 upcast), ``native``
    (the same with bf16 matmuls), ``fused`` (PyTorch's flash / memory-efficient SDPA kernels that
    return the log-sum-exp; the partial is then ``(o, m=lse, l=1)``, an equivalent statistic). The
    fused result is checked against ``ref`` (max-abs recorded). Also the seed's holder-compute point
    (c_t = 2048, N requesters = 1..256 query rows).
(b) ``splice``: fetch's splice: RoPE delta re-rotation of a fetched chunk's keys to new positions +
    scatter into a paged KV buffer, per chunk size, all layers (MLA latent: 27 layers, rope = last 64
    dims; GQA: 32 layers of K and V), per-layer launches as a serving stack does them.
(c) ``reprefill``: time per token x layer of recomputing a chunk with a transformer-layer-like
    workload (Qwen3-30B-A3B layer and a DeepSeek-V2-Lite-like layer; see ``LayerCfg``).
(d) ``crossover``: policies.costmodel's route/fetch/local predicate over (c_t, Mq) with the measured
    constants (holder compute, merge, splice, re-prefill c) and the seed's fabric table.
(e) ``calibration``: per-layer prefill of a Qwen3-Coder-30B-A3B layer at L = 1k..64k (flash SDPA
    causal + MoE FFN as batched GEMMs) and decode step versus batch and context, scaled to 48 layers,
    with least-squares fits ``prefill(L) = a L + b L^2`` and ``decode = d0 + d1 B + d2 B C``; raw bf16
    GEMM TFLOP/s and HBM copy bandwidth.

Timing: CUDA events around each call, ``warmup`` untimed calls, median (and min) of ``reps``. No
numpy needed. The JSON is rewritten after every section so a timeout still leaves what was measured.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import pathlib
import platform
import sys
import time
import traceback
from dataclasses import asdict, dataclass

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEV = "cuda"  # --device cpu runs a dry run of the whole script on CPU (timings meaningless)

SEED_000 = {
    "holder_compute_decode_us": [15, 37],
    "holder_compute_saturated_N256_us_max": 400,
    "merge_us_max": 25,
    "splice_ms": {"55": 2.77, "1024": 2.78, "2048": 2.91, "4096": 3.06},
    "route_rt_Mq1024_ibgda_us": 116,
    "local_c_us_per_token_layer": [0.5, 1.5],
    "source": "seed 000 (Ma et al., 'Move the Query, Not the Cache'), H100 SXM5, DeepSeek-V2-Lite, FlashMLA",
}
# DESIGN.md's H20 fit of full prefill (Qwen3-Coder-30B-A3B, whole model): 50 us x L + 2.94e-9 s x L^2.
SEED_H20_PREFILL = {"a_s_per_token": 50e-6, "b_s_per_token2": 2.94e-9}


# ------------------------------------------------------------------------------------------------
# timing helpers
# ------------------------------------------------------------------------------------------------


class Budget:
    """Wall-clock budget for the whole script (perf_counter is fine here: this is a benchmark)."""

    def __init__(self, seconds: float):
        self.t0 = time.perf_counter()
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.t0)

    def over(self) -> bool:
        return self.left() <= 0


def cuda_time_us(torch, fn, *, warmup: int, reps: int, graph: bool = True) -> dict:
    """Median/min microseconds of ``fn()`` over ``reps`` calls, each bracketed by CUDA events.

    With ``graph`` also the same for a CUDA-graph replay of ``fn`` (``graph_median_us``).
    """
    for _ in range(warmup):
        fn()
    if DEV == "cpu":  # dry run only
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        times.sort()
        return {"median_us": round(times[len(times) // 2], 3), "min_us": round(times[0], 3), "reps": reps, "cpu_dry_run": True}
    torch.cuda.synchronize()
    res = {**_event_times(torch, fn, reps), "reps": reps}
    if graph:
        # Eager timings of a many-kernel Python function are bounded by host launch overhead (~5-10 us
        # per kernel); replaying a captured CUDA graph gives the GPU-side time a fused or graphed
        # serving stack (vLLM decode runs under CUDA graphs) would see.
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            g.replay()
            torch.cuda.synchronize()
            gt = _event_times(torch, g.replay, reps)
            res["graph_median_us"], res["graph_min_us"] = gt["median_us"], gt["min_us"]
            del g
        except Exception as exc:  # noqa: BLE001 - record and continue: one failing kernel must not end the run
            res["graph_error"] = f"{type(exc).__name__}: {exc}"[:200]
            torch.cuda.synchronize()
    return res


def _event_times(torch, fn, reps: int) -> dict:
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    times.sort()
    return {"median_us": round(times[len(times) // 2], 3), "min_us": round(times[0], 3)}


def best_us(t: dict | None) -> float | None:
    """The graph-replay median when captured, else the eager median (None if not measured)."""
    if not isinstance(t, dict):
        return None
    return t.get("graph_median_us", t.get("median_us"))


def empty_cache(torch) -> None:
    if DEV == "cuda":
        torch.cuda.empty_cache()


def lstsq(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Ordinary least squares via normal equations (tiny systems only; no numpy on the device)."""
    n = len(rows[0])
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    aty = [sum(r[i] * y for r, y in zip(rows, ys)) for i in range(n)]
    # Gaussian elimination with partial pivoting.
    m = [ata[i] + [aty[i]] for i in range(n)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        if abs(m[c][c]) < 1e-300:
            return [float("nan")] * n
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    return [m[i][n] / m[i][i] for i in range(n)]


def fit_quality(pred: list[float], ys: list[float]) -> float:
    """Mean absolute percentage error of a fit, percent."""
    return round(100.0 * sum(abs(p - y) / y for p, y in zip(pred, ys) if y) / max(len(ys), 1), 2)


# ------------------------------------------------------------------------------------------------
# (a) partial attention and merge
# ------------------------------------------------------------------------------------------------

ATTN_SHAPES = {
    # name: (Hq, Hkv, d_qk, d_v, latent, scale)
    "mla16": (16, 1, 576, 512, True, 192 ** -0.5),
    "mla128": (128, 1, 576, 512, True, 192 ** -0.5),
    "gqa32x8": (32, 8, 128, 128, False, 128 ** -0.5),
}


def fused_partial(torch, q, k, v, scale):
    """Partial via PyTorch's fused SDPA kernels with LSE: regroup heads as rows (MQA/GQA trick).

    q [Mq, Hq, d], k [N, Hkv, d], v [N, Hkv, dv] -> query [1, Hkv, Mq*G, d], key [1, Hkv, N, d].
    Flash when d_qk == d_v <= 256, else memory-efficient attention (which allows d_v != d_qk).
    Returns (o [Mq,Hq,dv], lse [Mq,Hq]) - the partial (o, m=lse, l=1).
    """
    mq, hq, d = q.shape
    _, hkv, dv = v.shape
    g = hq // hkv
    qq = q.reshape(mq, hkv, g, d).permute(1, 0, 2, 3).reshape(1, hkv, mq * g, d)
    kk = k.permute(1, 0, 2).unsqueeze(0)
    vv = v.permute(1, 0, 2).unsqueeze(0)
    if d == dv and d <= 256:
        out = torch.ops.aten._scaled_dot_product_flash_attention(qq, kk, vv, 0.0, False, False, scale=scale)
        o, lse = out[0], out[1]
    else:
        try:
            out = torch.ops.aten._scaled_dot_product_efficient_attention(qq, kk, vv, None, True, 0.0, False, scale=scale)
        except RuntimeError:  # a kernel that wants dense K/V: pay the copy (counted in the timing)
            out = torch.ops.aten._scaled_dot_product_efficient_attention(
                qq, kk.contiguous(), vv.contiguous(), None, True, 0.0, False, scale=scale)
        o, lse = out[0], out[1]
    o = o.reshape(hkv, mq, g, dv).permute(1, 0, 2, 3).reshape(mq, hq, dv)
    lse = lse[..., : mq * g].reshape(hkv, mq, g).permute(1, 0, 2).reshape(mq, hq)
    return o, lse


def section_partial(torch, cfg, res, budget):
    from engines.attention.merge import merge_partial_stats
    from engines.attention.partial import Partial, partial_attention

    dev = DEV
    out = {"grid": [], "holder_compute_ct2048": [], "merge": [], "fused_check": []}
    res["partial"] = out
    mem_cap = cfg.ref_mem_cap_bytes
    for shape_name, (hq, hkv, dqk, dv, latent, scale) in ATTN_SHAPES.items():
        for ct in cfg.chunks:
            if budget.over():
                out.setdefault("skipped", []).append(f"{shape_name} ct={ct}: budget")
                continue
            torch.manual_seed(0)
            if latent:
                lat = torch.randn(ct, 1, dqk, device=dev, dtype=torch.bfloat16)
                k, v = lat, lat[..., :dv]
            else:
                k = torch.randn(ct, hkv, dqk, device=dev, dtype=torch.bfloat16)
                v = torch.randn(ct, hkv, dv, device=dev, dtype=torch.bfloat16)
            for mq in cfg.rows:
                q = torch.randn(mq, hq, dqk, device=dev, dtype=torch.bfloat16)
                rec = {"shape": shape_name, "ct": ct, "mq": mq}
                score_bytes = hq * mq * ct * 4
                for variant in ("ref", "native", "fused"):
                    if variant != "fused" and score_bytes * 3 > mem_cap:
                        rec[variant] = {"skipped": f"unfused logits {score_bytes * 3 / 2**30:.1f} GiB > cap"}
                        continue
                    try:
                        if variant == "ref":
                            fn = lambda: partial_attention(q, k, v, scale=scale)
                        elif variant == "native":
                            fn = lambda: partial_attention(q, k, v, scale=scale, upcast=False)
                        else:
                            fn = lambda: fused_partial(torch, q, k, v, scale)
                        rec[variant] = cuda_time_us(torch, fn, warmup=cfg.warmup, reps=cfg.reps)
                    except Exception as exc:  # noqa: BLE001 - record and continue: one failing kernel must not end the run  # record and go on: one unsupported kernel must not stop the run
                        rec[variant] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                    empty_cache(torch)
                # fused vs reference correctness at modest sizes
                if score_bytes * 3 <= mem_cap and "error" not in rec.get("fused", {}) and mq <= 64:
                    try:
                        p_ref = partial_attention(q, k, v, scale=scale)
                        o_f, lse = fused_partial(torch, q, k, v, scale)
                        lse_ref = p_ref.m + torch.log(p_ref.l)
                        out["fused_check"].append({
                            "shape": shape_name, "ct": ct, "mq": mq,
                            "o_maxabs": float((o_f.float() - p_ref.o).abs().max()),
                            "lse_maxabs": float((lse.float() - lse_ref).abs().max()),
                        })
                    except Exception as exc:  # noqa: BLE001 - record and continue: one failing kernel must not end the run
                        out["fused_check"].append({"shape": shape_name, "ct": ct, "mq": mq, "error": str(exc)[:300]})
                out["grid"].append(rec)
            del k, v
            empty_cache(torch)

    # Seed 000 Fig. 4(b): holder compute at c_t = 2048 for N routed requesters (one row each).
    for shape_name in ("mla16", "mla128"):
        hq, hkv, dqk, dv, latent, scale = ATTN_SHAPES[shape_name]
        lat = torch.randn(2048, 1, dqk, device=dev, dtype=torch.bfloat16)
        k, v = lat, lat[..., :dv]
        for n_req in cfg.requesters:
            if budget.over():
                break
            q = torch.randn(n_req, hq, dqk, device=dev, dtype=torch.bfloat16)
            rec = {"shape": shape_name, "ct": 2048, "n_requesters": n_req}
            for variant, fn in (
                ("ref", lambda: partial_attention(q, k, v, scale=scale)),
                ("native", lambda: partial_attention(q, k, v, scale=scale, upcast=False)),
                ("fused", lambda: fused_partial(torch, q, k, v, scale)),
            ):
                try:
                    rec[variant] = cuda_time_us(torch, fn, warmup=cfg.warmup, reps=cfg.reps)
                except Exception as exc:  # noqa: BLE001 - record and continue: one failing kernel must not end the run
                    rec[variant] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            out["holder_compute_ct2048"].append(rec)

    # Merge of P partials (the requester side), d_v = 512.
    for hq in (16, 128):
        for n_parts in cfg.merge_parts:
            for mq in cfg.rows:
                if budget.over():
                    break
                parts = [
                    Partial(
                        torch.randn(mq, hq, 512, device=dev),
                        torch.randn(mq, hq, device=dev),
                        torch.rand(mq, hq, device=dev) + 0.5,
                    )
                    for _ in range(n_parts)
                ]
                t = cuda_time_us(torch, lambda: merge_partial_stats(parts), warmup=cfg.warmup, reps=cfg.reps)
                out["merge"].append({"hq": hq, "parts": n_parts, "mq": mq, **t})


# ------------------------------------------------------------------------------------------------
# (b) fetch splice: RoPE delta re-rotation + scatter into a paged buffer
# ------------------------------------------------------------------------------------------------


def rope_inv_freq(torch, dim, base=10000.0, device=None):
    return 1.0 / (base ** (torch.arange(0, dim, 2, device=device or DEV, dtype=torch.float32) / dim))


def rotate_delta(torch, x, delta, inv_freq):
    """Rotate the (interleaved-pair) rope dims of ``x`` [T, ..., R] by ``delta`` [T] positions (fp32 math)."""
    ang = delta.float()[:, None] * inv_freq[None, :]  # [T, R/2]
    shape = [x.shape[0]] + [1] * (x.dim() - 2) + [ang.shape[1]]
    cos, sin = ang.cos().view(shape), ang.sin().view(shape)
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    out = torch.empty_like(xf)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.to(x.dtype)


def section_splice(torch, cfg, res, budget):
    dev = DEV
    out = {"mla_27layers": [], "gqa_32layers": [], "notes": (
        "per chunk: for every layer, delta-rotate the rope band of the fetched keys from their old "
        "positions to new ones and scatter the tokens into a paged cache (block 16) through a block "
        "table; one launch sequence per layer (as a serving stack splices layer caches); 'batched' "
        "does all layers in one pass. The wire pull is not included.")}
    res["splice"] = out
    block = 16
    inv64 = rope_inv_freq(torch, 64)
    inv128 = rope_inv_freq(torch, 128)
    for ct in cfg.splice_chunks:
        if budget.over():
            out.setdefault("skipped", []).append(f"ct={ct}: budget")
            continue
        nblk = (ct + block - 1) // block
        pool_blocks = nblk * 2 + 8
        # a shuffled block table: the destination blocks are wherever the pool had free blocks
        perm = torch.randperm(pool_blocks, device=dev)[:nblk]
        tok = torch.arange(ct, device=dev)
        slots = perm[tok // block] * block + tok % block
        delta = torch.full((ct,), 12345, device=dev, dtype=torch.int64)  # re-homing to a new offset

        # MLA: latent [ct, 576] per layer, rope = last 64 dims.
        layers = 27
        src = torch.randn(layers, ct, 576, device=dev, dtype=torch.bfloat16)
        paged = torch.zeros(layers, pool_blocks * block, 576, device=dev, dtype=torch.bfloat16)

        def mla_splice():
            for li in range(layers):
                x = src[li].clone()
                x[:, 512:] = rotate_delta(torch, x[:, 512:], delta, inv64)
                paged[li].index_copy_(0, slots, x)

        def mla_splice_batched():
            x = src.clone()
            rot = rotate_delta(torch, x[:, :, 512:].transpose(0, 1), delta, inv64)  # [ct, layers, 64]
            x[:, :, 512:] = rot.transpose(0, 1)
            paged.index_copy_(1, slots, x)

        rec = {"ct": ct}
        for name, fn in (("per_layer", mla_splice), ("batched", mla_splice_batched)):
            try:
                t = cuda_time_us(torch, fn, warmup=cfg.warmup, reps=max(3, cfg.reps // 2))
                rec[name] = {**t, "ms": round(t["median_us"] / 1000, 3)}  # eager: as a serving stack launches it
            except Exception as exc:  # noqa: BLE001 - record and continue: one failing kernel must not end the run
                rec[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        out["mla_27layers"].append(rec)
        src = paged = None  # free before the next size (the closures above are done)
        empty_cache(torch)

        # GQA: keys [ct, 8, 128] (full-dim rope) + values, 32 layers.
        layers = 32
        if layers * ct * 8 * 128 * 2 * 2 * 3 < cfg.ref_mem_cap_bytes:
            ks = torch.randn(layers, ct, 8, 128, device=dev, dtype=torch.bfloat16)
            vs = torch.randn(layers, ct, 8, 128, device=dev, dtype=torch.bfloat16)
            kp = torch.zeros(layers, pool_blocks * block, 8, 128, device=dev, dtype=torch.bfloat16)
            vp = torch.zeros_like(kp)

            def gqa_splice():
                for li in range(layers):
                    kp[li].index_copy_(0, slots, rotate_delta(torch, ks[li], delta, inv128))
                    vp[li].index_copy_(0, slots, vs[li])

            rec = {"ct": ct}
            try:
                t = cuda_time_us(torch, gqa_splice, warmup=cfg.warmup, reps=max(3, cfg.reps // 2))
                rec["per_layer"] = {**t, "ms": round(t["median_us"] / 1000, 3)}
            except Exception as exc:  # noqa: BLE001 - record and continue: one failing kernel must not end the run
                rec["per_layer"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            out["gqa_32layers"].append(rec)
            ks = vs = kp = vp = None
            empty_cache(torch)


# ------------------------------------------------------------------------------------------------
# transformer-layer workloads for (c) and (e)
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerCfg:
    """A decoder layer reduced to its GEMMs, attention and MoE; norms/RoPE as cheap elementwise ops.

    Approximations (documented in the JSON): routing is perfectly balanced (each expert gets
    ``tokens * top_k / n_experts`` rows; real routing is skewed, a little slower); the MoE runs as
    gather -> two batched GEMMs (gate_up, down) -> scatter-add, like a grouped-GEMM MoE kernel;
    attention is PyTorch's flash SDPA (causal), KV heads expanded outside the timed region for
    prefill (flash-attn reads grouped KV natively); no tensor parallelism, no CUDA graphs.
    """

    name: str
    hidden: int
    n_q: int
    n_kv: int
    d_qk: int
    d_v: int
    q_proj_out: int  # output width of the query projection(s)
    kv_proj_out: int  # output width of the key/value projection(s)
    o_proj_in: int
    n_experts: int
    top_k: int
    moe_inter: int
    shared_inter: int  # dense (shared-expert) MLP intermediate size, 0 if none
    n_layers: int


QWEN3_30B_A3B = LayerCfg(
    "qwen3-coder-30b-a3b", hidden=2048, n_q=32, n_kv=4, d_qk=128, d_v=128,
    q_proj_out=32 * 128, kv_proj_out=2 * 4 * 128, o_proj_in=32 * 128,
    n_experts=128, top_k=8, moe_inter=768, shared_inter=0, n_layers=48,
)
# DeepSeek-V2-Lite approximated: MLA prefill runs as MHA with 16 heads of d_qk 192 (128 nope + 64
# rope) - here d_v is padded to 192 so flash applies; q proj 2048->3072, kv_a 2048->576 then
# kv_b 512->16x256 (folded into kv_proj_out), o 2048->2048; 64 experts top-6 of 1408 + 2 shared.
DSV2_LITE = LayerCfg(
    "deepseek-v2-lite-like", hidden=2048, n_q=16, n_kv=16, d_qk=192, d_v=192,
    q_proj_out=16 * 192, kv_proj_out=576 + 16 * 256, o_proj_in=16 * 128,
    n_experts=64, top_k=6, moe_inter=1408, shared_inter=2 * 1408, n_layers=27,
)


class Layer:
    """Weights and buffers for one layer; ``prefill(L)`` and ``decode(B, C)`` return callables."""

    def __init__(self, torch, c: LayerCfg):
        self.t, self.c = torch, c
        dev, dt = DEV, torch.bfloat16
        s = 0.02
        self.w_q = torch.randn(c.hidden, c.q_proj_out, device=dev, dtype=dt) * s
        self.w_kv = torch.randn(c.hidden, c.kv_proj_out, device=dev, dtype=dt) * s
        self.w_o = torch.randn(c.o_proj_in, c.hidden, device=dev, dtype=dt) * s
        self.w_router = torch.randn(c.hidden, c.n_experts, device=dev, dtype=dt) * s
        self.w_up = torch.randn(c.n_experts, c.hidden, 2 * c.moe_inter, device=dev, dtype=dt) * s
        self.w_down = torch.randn(c.n_experts, c.moe_inter, c.hidden, device=dev, dtype=dt) * s
        if c.shared_inter:
            self.w_sup = torch.randn(c.hidden, 2 * c.shared_inter, device=dev, dtype=dt) * s
            self.w_sdown = torch.randn(c.shared_inter, c.hidden, device=dev, dtype=dt) * s
        self.norm_w = torch.ones(c.hidden, device=dev, dtype=dt)

    def _moe(self, x, active_experts: int | None = None):
        t, c = self.t, self.c
        rows = x.shape[0] * c.top_k
        e = c.n_experts if active_experts is None else active_experts
        per = max(1, math.ceil(rows / e))
        _ = x @ self.w_router  # router logits (top-k itself is negligible next to the GEMMs)
        idx = (t.arange(e * per, device=x.device) % x.shape[0])
        xe = x.index_select(0, idx).view(e, per, c.hidden)
        h = t.bmm(xe, self.w_up[:e])
        h = t.nn.functional.silu(h[..., : c.moe_inter]) * h[..., c.moe_inter:]
        y = t.bmm(h, self.w_down[:e]).view(e * per, c.hidden)
        out = t.zeros_like(x)
        out.index_add_(0, idx, y)
        if c.shared_inter:
            hs = x @ self.w_sup
            hs = t.nn.functional.silu(hs[..., : c.shared_inter]) * hs[..., c.shared_inter:]
            out = out + hs @ self.w_sdown
        return out

    def _norm(self, x):
        return self.t.nn.functional.rms_norm(x, (x.shape[-1],), self.norm_w, 1e-6)

    def prefill_parts(self, n_tokens: int):
        """Callables for the whole layer and its parts over a prompt of ``n_tokens`` (no cache)."""
        t, c = self.t, self.c
        x = t.randn(n_tokens, c.hidden, device=DEV, dtype=t.bfloat16)
        q = t.randn(1, c.n_q, n_tokens, c.d_qk, device=DEV, dtype=t.bfloat16)
        k = t.randn(1, c.n_q, n_tokens, c.d_qk, device=DEV, dtype=t.bfloat16)  # kv expanded to n_q heads
        v = t.randn(1, c.n_q, n_tokens, c.d_v, device=DEV, dtype=t.bfloat16)
        ao = t.randn(n_tokens, c.o_proj_in, device=DEV, dtype=t.bfloat16)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def attn():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return t.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

        def proj():
            h = self._norm(x)
            _ = h @ self.w_q
            _ = h @ self.w_kv
            return ao @ self.w_o

        def moe():
            return self._moe(self._norm(x))

        def layer():
            h = self._norm(x)
            _ = h @ self.w_q
            _ = h @ self.w_kv
            a = attn()
            o = a.transpose(1, 2).reshape(n_tokens, c.n_q * c.d_v)[:, : c.o_proj_in] @ self.w_o
            x2 = x + o
            return x2 + self._moe(self._norm(x2))

        return {"layer": layer, "attention": attn, "projections": proj, "moe": moe}

    def decode_step(self, batch: int, context: int):
        """One decode step of ``batch`` sequences each at ``context`` tokens (KV cache for one layer)."""
        t, c = self.t, self.c
        x = t.randn(batch, c.hidden, device=DEV, dtype=t.bfloat16)
        g = c.n_q // c.n_kv
        # decode query regrouped as g rows per KV head: the flash kernel then reads each KV head once
        q = t.randn(batch, c.n_kv, g, c.d_qk, device=DEV, dtype=t.bfloat16)
        kc = t.randn(batch, c.n_kv, context, c.d_qk, device=DEV, dtype=t.bfloat16)
        vc = t.randn(batch, c.n_kv, context, c.d_v, device=DEV, dtype=t.bfloat16)
        active = min(c.n_experts, batch * c.top_k)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def step():
            h = self._norm(x)
            _ = h @ self.w_q
            _ = h @ self.w_kv
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
                a = t.nn.functional.scaled_dot_product_attention(q, kc, vc)
            o = a.reshape(batch, c.n_q * c.d_v)[:, : c.o_proj_in] @ self.w_o
            x2 = x + o
            return x2 + self._moe(self._norm(x2), active_experts=active)

        return step


def section_reprefill(torch, cfg, res, budget):
    out = {"notes": LayerCfg.__doc__.strip(), "layers": []}
    res["reprefill"] = out
    for lc in (DSV2_LITE, QWEN3_30B_A3B):
        layer = Layer(torch, lc)
        recs = []
        for n in cfg.reprefill_chunks:
            if budget.over():
                break
            try:
                t = cuda_time_us(torch, layer.prefill_parts(n)["layer"], warmup=cfg.warmup, reps=max(3, cfg.reps // 2))
                us = best_us(t)
                recs.append({"chunk": n, "layer_us": us, "layer_eager_us": t["median_us"],
                             "us_per_token_layer": round(us / n, 4),
                             "chunk_all_layers_ms": round(us * lc.n_layers / 1000, 3)})
            except Exception as exc:  # noqa: BLE001 - record and continue: one failing kernel must not end the run
                recs.append({"chunk": n, "error": f"{type(exc).__name__}: {exc}"[:300]})
            empty_cache(torch)
        out["layers"].append({"cfg": asdict(lc), "points": recs})
        del layer
        empty_cache(torch)


def section_calibration(torch, cfg, res, budget):
    lc = QWEN3_30B_A3B
    out = {"model": asdict(lc), "notes": LayerCfg.__doc__.strip(), "prefill": [], "decode": []}
    res["calibration"] = out
    # raw device numbers
    try:
        n = cfg.gemm_n
        a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
        t = cuda_time_us(torch, lambda: a @ b, warmup=cfg.warmup, reps=cfg.reps, graph=False)
        out["gemm_bf16"] = {"n": n, **t, "tflops": round(2 * n**3 / (t["median_us"] * 1e-6) / 1e12, 1)}
        a = b = None
        nbytes = cfg.copy_bytes
        src = torch.empty(nbytes // 2, device=DEV, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        t = cuda_time_us(torch, lambda: dst.copy_(src), warmup=cfg.warmup, reps=cfg.reps, graph=False)
        out["hbm_copy"] = {"bytes": nbytes, **t, "gbps_read_plus_write": round(2 * nbytes / (t["median_us"] * 1e-6) / 1e9, 1)}
        src = dst = None
        empty_cache(torch)
    except Exception as exc:  # noqa: BLE001 - record and continue: one failing kernel must not end the run
        out["raw_error"] = f"{type(exc).__name__}: {exc}"[:300]

    layer = Layer(torch, lc)
    for n in cfg.prefill_lengths:
        if budget.over():
            out.setdefault("skipped", []).append(f"prefill L={n}: budget")
            continue
        rec = {"L": n}
        try:
            parts = layer.prefill_parts(n)
            for name, fn in parts.items():
                t = cuda_time_us(torch, fn, warmup=1, reps=cfg.prefill_reps)
                rec[name + "_us"] = best_us(t)
                rec[name + "_eager_us"] = t["median_us"]
            rec["model_s"] = round(rec["layer_us"] * lc.n_layers * 1e-6, 5)
        except Exception as exc:  # noqa: BLE001 - record and continue: one failing kernel must not end the run
            rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
        out["prefill"].append(rec)
        empty_cache(torch)
    for bsz in cfg.decode_batches:
        for ctx in cfg.decode_contexts:
            if budget.over():
                out.setdefault("skipped", []).append(f"decode B={bsz} C={ctx}: budget")
                continue
            if bsz * ctx * lc.n_kv * (lc.d_qk + lc.d_v) * 2 > cfg.ref_mem_cap_bytes:
                continue
            rec = {"B": bsz, "C": ctx}
            try:
                t = cuda_time_us(torch, layer.decode_step(bsz, ctx), warmup=cfg.warmup, reps=cfg.reps)
                rec["layer_us"] = best_us(t)
                rec["layer_eager_us"] = t["median_us"]
            except Exception as exc:  # noqa: BLE001 - record and continue: one failing kernel must not end the run
                rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
            out["decode"].append(rec)
            empty_cache(torch)
    del layer
    empty_cache(torch)


def fit_calibration(res: dict) -> None:
    """Whole-model (48-layer) times from the per-layer medians (graph replay when captured), and fits."""
    out = res.get("calibration")
    if not out:
        return
    n_layers = out["model"]["n_layers"]
    for r in out["prefill"]:
        if r.get("layer_us") is not None:
            r["model_s"] = round(r["layer_us"] * n_layers * 1e-6, 6)
    for r in out["decode"]:
        if r.get("layer_us") is not None:
            r["step_s"] = round(r["layer_us"] * n_layers * 1e-6, 6)
    pts = [r for r in out["prefill"] if "model_s" in r]
    if len(pts) >= 2:
        a, b = lstsq([[r["L"], r["L"] ** 2] for r in pts], [r["model_s"] for r in pts])
        pred = [a * r["L"] + b * r["L"] ** 2 for r in pts]
        out["prefill_fit"] = {"form": "model_s = a*L + b*L^2 (48 layers)", "a_s_per_token": a, "b_s_per_token2": b,
                              "mape_pct": fit_quality(pred, [r["model_s"] for r in pts]),
                              "seed_h20_fit": SEED_H20_PREFILL}
    if len(pts) >= 3:
        a0, a, b = lstsq([[1.0, r["L"], r["L"] ** 2] for r in pts], [r["model_s"] for r in pts])
        out["prefill_fit3"] = {"form": "model_s = c + a*L + b*L^2", "c_s": a0, "a_s_per_token": a, "b_s_per_token2": b}

    dp = [r for r in out["decode"] if "step_s" in r]
    if len(dp) >= 3:
        d0, d1, d2 = lstsq([[1.0, r["B"], r["B"] * r["C"]] for r in dp], [r["step_s"] for r in dp])
        pred = [d0 + d1 * r["B"] + d2 * r["B"] * r["C"] for r in dp]
        out["decode_fit"] = {"form": "step_s = d0 + d1*B + d2*B*C (48 layers; C = context tokens per sequence)",
                             "d0_s": d0, "d1_s_per_seq": d1, "d2_s_per_ctx_token": d2,
                             "mape_pct": fit_quality(pred, [r["step_s"] for r in dp])}
    if len(dp) >= 4:
        # MoE decode reads the weights of every distinct active expert: min(E, B * top_k) of them.
        e, k = out["model"]["n_experts"], out["model"]["top_k"]
        rows = [[1.0, min(e, r["B"] * k), r["B"], r["B"] * r["C"]] for r in dp]
        d0, de, d1, d2 = lstsq(rows, [r["step_s"] for r in dp])
        pred = [d0 + de * x[1] + d1 * x[2] + d2 * x[3] for x in rows]
        out["decode_fit_moe"] = {"form": "step_s = d0 + de*min(E, B*top_k) + d1*B + d2*B*C (48 layers)",
                                 "d0_s": d0, "de_s_per_active_expert": de, "d1_s_per_seq": d1,
                                 "d2_s_per_ctx_token": d2, "mape_pct": fit_quality(pred, [r["step_s"] for r in dp])}
    if len(pts) >= 3:
        f3 = out["prefill_fit3"]
        pred = [f3["c_s"] + f3["a_s_per_token"] * r["L"] + f3["b_s_per_token2"] * r["L"] ** 2 for r in pts]
        f3["mape_pct"] = fit_quality(pred, [r["model_s"] for r in pts])


def postprocess(res: dict) -> None:
    """Everything derived from raw timings (fits, crossover map, comparison); CPU-safe, rerunnable."""
    fit_calibration(res)
    if "partial" in res or "splice" in res:
        try:
            section_crossover(res)
        except Exception:  # noqa: BLE001 - recorded in the JSON
            res.setdefault("errors", {})["d"] = traceback.format_exc()[-2000:]
    res["comparison"] = comparison(res)


# ------------------------------------------------------------------------------------------------
# (d) crossover map (pure Python; also runnable on CPU from a measurement JSON)
# ------------------------------------------------------------------------------------------------


def measured_constants(res: dict) -> dict:
    """Holder compute, merge, splice and re-prefill c distilled from sections a-c (None if missing)."""
    consts: dict = {"t_compute_s": None, "t_merge_s": None, "splice_s": None, "local_c_s": None}
    hc = (res.get("partial") or {}).get("holder_compute_ct2048") or []
    best = []
    for r in hc:
        if r.get("shape") == "mla16" and r.get("n_requesters", 99) <= 16:
            vals = [best_us(r.get(v)) for v in ("fused", "native", "ref") if best_us(r.get(v)) is not None]
            if vals:
                best.append(min(vals))
    if best:
        consts["t_compute_s"] = max(best) * 1e-6  # decode range upper end, fastest implementation
    mg = [best_us(r) for r in (res.get("partial") or {}).get("merge", []) if r.get("hq") == 16 and r.get("parts") == 2 and r.get("mq", 0) <= 64]
    if mg:
        consts["t_merge_s"] = max(mg) * 1e-6
    sp = [r for r in (res.get("splice") or {}).get("mla_27layers", []) if isinstance(r.get("per_layer"), dict) and "ms" in r["per_layer"]]
    if sp:
        near = min(sp, key=lambda r: abs(r["ct"] - 2048))
        consts["splice_s"] = near["per_layer"]["ms"] * 1e-3
        consts["splice_ct"] = near["ct"]
    for lay in (res.get("reprefill") or {}).get("layers", []):
        if lay["cfg"]["name"].startswith("deepseek"):
            cs = [p["us_per_token_layer"] for p in lay["points"] if "us_per_token_layer" in p]
            if cs:
                consts["local_c_s"] = min(cs) * 1e-6
    return consts


def section_crossover(res: dict, rows=(1, 8, 64, 256, 1024, 4096, 16384), chunks=(16, 64, 256, 1024, 2048, 8192, 65536)):
    from policies import costmodel as cm

    consts = measured_constants(res)
    kw = {}
    if consts["t_compute_s"] is not None:
        kw["t_compute_s"] = consts["t_compute_s"]
    if consts["t_merge_s"] is not None:
        kw["t_merge_s"] = consts["t_merge_s"]
    if consts["splice_s"] is not None:
        kw["splice_s"] = consts["splice_s"]
    if consts["local_c_s"] is not None:
        kw["local_c_s"] = consts["local_c_s"]
    out = {"constants": consts, "used": kw, "maps": {}}
    for fab_name in ("h100_ibgda", "h100_nvlink4", "pcie_gen5"):
        fab = cm.FABRICS[fab_name]
        grid = {}
        for mq in rows:
            grid[str(mq)] = {}
            for ct in chunks:
                ch = cm.choose_primitive(fab, mq=mq, ct=ct, **kw)
                grid[str(mq)][str(ct)] = {"choice": ch.primitive, "route_us": round(ch.route_s * 1e6, 1),
                                          "fetch_us": round(ch.fetch_s * 1e6, 1), "local_us": round(ch.local_s * 1e6, 1)}
        cross = cm.fetch_local_crossover_tokens(
            fab, **{k: v for k, v in kw.items() if k in ("splice_s", "local_c_s")})
        out["maps"][fab_name] = {"grid_mq_by_ct": grid, "fetch_beats_local_above_tokens": round(cross, 1)}
    res["crossover"] = out


# ------------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------------


@dataclass
class Cfg:
    warmup: int = 3
    reps: int = 20
    prefill_reps: int = 5
    rows: tuple = (1, 8, 64, 512)
    chunks: tuple = (1024, 4096, 16384, 65536)
    requesters: tuple = (1, 2, 4, 8, 16, 64, 256)
    merge_parts: tuple = (2, 8)
    splice_chunks: tuple = (64, 1024, 2048, 4096, 16384, 65536)
    reprefill_chunks: tuple = (512, 2048, 8192)
    prefill_lengths: tuple = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
    decode_batches: tuple = (1, 8, 32, 64, 128)
    decode_contexts: tuple = (1024, 4096, 16384, 32768)
    gemm_n: int = 8192
    copy_bytes: int = 2 << 30
    ref_mem_cap_bytes: int = 24 << 30
    budget_s: float = 420.0


SMOKE = Cfg(warmup=1, reps=3, prefill_reps=2, rows=(1, 8), chunks=(1024,), requesters=(1, 8), merge_parts=(2,),
            splice_chunks=(64, 1024), reprefill_chunks=(512,), prefill_lengths=(1024, 2048, 4096),
            decode_batches=(1, 8), decode_contexts=(1024, 4096), gemm_n=2048, copy_bytes=64 << 20, budget_s=150.0)


def env_info(torch) -> dict:
    info = {
        "utc_date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "host": platform.node(),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(0), sm_count=p.multi_processor_count,
                    memory_gib=round(p.total_memory / 2**30, 1), capability=f"{p.major}.{p.minor}")
        try:
            info["cudnn"] = torch.backends.cudnn.version()
        except Exception:  # noqa: BLE001, S110 - optional field
            pass
    return info


def comparison(res: dict) -> dict:
    """Our numbers next to seed 000's, in a few lines a reader can check at a glance."""
    cmp: dict = {"seed_000": SEED_000}
    hc = (res.get("partial") or {}).get("holder_compute_ct2048") or []
    for r in hc:
        key = f"holder_{r['shape']}_N{r['n_requesters']}_us"
        cmp[key] = {v: {"eager": r[v].get("median_us"), "graph": r[v].get("graph_median_us")} for v in ("ref", "native", "fused") if isinstance(r.get(v), dict)}
    mg = (res.get("partial") or {}).get("merge") or []
    if mg:
        cmp["merge_us_max_over_grid_graph"] = max(best_us(r) for r in mg)
        cmp["merge_us_max_over_grid_eager"] = max(r["median_us"] for r in mg)
        cmp["merge_us_2parts_16h_Mq<=64_graph"] = max((best_us(r) for r in mg if r["parts"] == 2 and r["hq"] == 16 and r["mq"] <= 64), default=None)
    sp = (res.get("splice") or {}).get("mla_27layers") or []
    cmp["splice_ms_mla_per_layer_eager"] = {str(r["ct"]): r.get("per_layer", {}).get("ms") for r in sp}
    cmp["splice_ms_mla_per_layer_graph"] = {str(r["ct"]): (r.get("per_layer", {}).get("graph_median_us") or 0) / 1000 for r in sp}
    cmp["splice_ms_mla_batched"] = {str(r["ct"]): r.get("batched", {}).get("ms") for r in sp}
    for lay in (res.get("reprefill") or {}).get("layers", []):
        cmp[f"reprefill_us_per_token_layer_{lay['cfg']['name']}"] = {str(p["chunk"]): p.get("us_per_token_layer") for p in lay["points"]}
    return cmp


def run(cfg: Cfg, out_dir: pathlib.Path, sections: list[str]) -> pathlib.Path:
    import torch

    if DEV == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_measure: no CUDA device (torch.cuda.is_available() is False)")
    torch.backends.cuda.matmul.allow_tf32 = False
    budget = Budget(cfg.budget_s)
    res: dict = {"env": env_info(torch), "config": asdict(cfg), "errors": {}, "section_s": {}}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"h100-{res['env']['utc_date'][:10]}.json"
    if "H100" not in str(res["env"].get("device", "")):
        path = out_dir / f"gpu-{res['env']['utc_date'][:10]}.json"
    funcs = {
        "e": lambda: section_calibration(torch, cfg, res, budget),
        "a": lambda: section_partial(torch, cfg, res, budget),
        "b": lambda: section_splice(torch, cfg, res, budget),
        "c": lambda: section_reprefill(torch, cfg, res, budget),
        "d": lambda: None,  # derived in postprocess() after every section
    }
    for s in sections:
        t0 = time.perf_counter()
        print(f"[gpu_measure] section {s} (budget left {budget.left():.0f}s)", flush=True)
        try:
            funcs[s]()
        except Exception:  # noqa: BLE001 - a failed section is recorded, the rest still runs
            res["errors"][s] = traceback.format_exc()[-2000:]
            print(res["errors"][s], flush=True)
        res["section_s"][s] = round(time.perf_counter() - t0, 1)
        postprocess(res)
        path.write_text(json.dumps(res, indent=1, default=str))
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="output directory (default $OUT or .)")
    ap.add_argument("--smoke", action="store_true", help="tiny configuration (seconds)")
    ap.add_argument("--sections", default="a,b,c,e,d", help="comma list of a,b,c,d,e (d last: it uses a-c)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=None)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu = dry run of the code paths")
    ap.add_argument("--crossover-from", default=None, help="CPU only: redo fits, (d) and the comparison from a measurement JSON")
    args = ap.parse_args(argv)
    if args.crossover_from:
        src = pathlib.Path(args.crossover_from)
        res = json.loads(src.read_text())
        postprocess(res)
        out = pathlib.Path(args.out) / src.name
        out.write_text(json.dumps(res, indent=1, default=str))
        print(out)
        return 0
    global DEV
    DEV = args.device
    cfg = Cfg(**asdict(SMOKE)) if args.smoke else Cfg()
    if args.reps:
        cfg.reps = args.reps
    if args.budget_s:
        cfg.budget_s = args.budget_s
    path = run(cfg, pathlib.Path(args.out), [s.strip() for s in args.sections.split(",") if s.strip()])
    print(f"[gpu_measure] wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Fit a step-time :class:`~engines.emulated.profile.Profile` to measurements of a running engine.

The measurements (taken by ``gpuhit profile fit``) are of two kinds:

* **prefill probes**: one request alone on a cold engine, ``new`` prompt tokens computed after
  ``context`` cached ones, answered with one token. The engine's own histograms give its prefill
  time (scheduled -> first token: the prefill steps) and queue time; the client gives the TTFT it
  saw. The difference, TTFT - prefill, is what the emulator calls the frontend delay (HTTP, input
  processing, the engine loop picking the request up, streaming the first token back): the queue
  time of a probe alone on an idle engine is such a fixed cost, not queueing behind other work.
* **decode probes**: ``batch`` requests of ``context`` prompt tokens sent together, each generating
  ``tokens``, their prompts cached beforehand (so the batch's prefills are a block each and its
  decode steps are not mixed with long prefill chunks); the engine's decode time over
  ``tokens - 1`` is the mean decode step time at that batch size and context.

The step model is the profile's (``engines/emulated/profile.py``): a prefill of ``n`` new tokens
after ``c`` in ``k`` chunks costs ``k * (step_overhead + per_seq + chunk) + a * n + b * ((c + n)^2 - c^2)``
(``b`` is attention: each new token attends to the context and to the new tokens before it); a
decode step of ``B`` sequences with context sum ``C`` costs ``step_overhead + per_seq * B + d * C``.
The decode probes, whose intercept is ``step_overhead`` alone, separate it from the chunk overhead.
Both kinds are fitted together by non-negative least squares on relative errors (every probe
weighs the same however long it is), then the frontend line on the residual delays. The probes
held back from the fit are predicted with the fitted profile and their relative errors reported,
and every shape is also predicted by a fit without it (leave-one-out), which uses every probe.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuhit.errors import ConfigError

PARAMS = ("step_overhead_s", "per_seq_overhead_s", "prefill_per_token_s", "prefill_attn_s", "decode_per_ctx_token_s",
          "prefill_chunk_overhead_s")


@dataclass(frozen=True, slots=True)
class PrefillProbe:
    new: int  # prompt tokens computed
    context: int  # prompt tokens served from the prefix cache before them
    prefill_s: float  # engine: scheduled -> first token
    queue_s: float  # engine: arrival at the scheduler -> scheduled (recorded; part of the frontend delay)
    ttft_s: float  # client: request sent -> first streamed token
    # engine: its API server's arrival -> first token (vLLM's TTFT histogram); ttft_s minus it is the
    # HTTP path of a client talking to the engine directly (nan in measurements that lack it)
    engine_ttft_s: float = math.nan

    @property
    def frontend_s(self) -> float:
        return self.ttft_s - self.prefill_s


@dataclass(frozen=True, slots=True)
class DecodeProbe:
    batch: int
    context: int  # prompt tokens of each request
    tokens: int  # generated per request
    step_s: float  # engine: mean decode step time (decode time / (tokens - 1))


def chunks(new: int, max_batched: int) -> int:
    """Prefill steps a request of ``new`` uncached tokens takes alone (chunked prefill)."""
    return max(1, -(-new // max_batched))


def _prefill_row(p: PrefillProbe, max_batched: int) -> list[float]:
    k = chunks(p.new, max_batched)
    return [k, k, p.new, (p.context + p.new) ** 2 - p.context ** 2, 0.0, k]


def _decode_row(p: DecodeProbe) -> list[float]:
    # mean context over the decode steps: the prompt plus half the generated tokens
    ctx_sum = p.batch * (p.context + p.tokens / 2.0)
    return [1.0, p.batch, 0.0, 0.0, ctx_sum, 0.0]


def fit_steps(prefill: Sequence[PrefillProbe], decode: Sequence[DecodeProbe], max_batched: int,
              params: Sequence[str] = PARAMS) -> dict[str, float]:
    """The step-time parameters (:data:`PARAMS`), non-negative, minimizing relative error; those not
    in ``params`` are held at 0 (a smaller model, for comparing models on the same probes)."""
    from scipy.optimize import nnls

    if len(prefill) < 3 or len(decode) < 2:
        raise ConfigError(f"a fit needs at least 3 prefill and 2 decode probes, got {len(prefill)} and {len(decode)}")
    rows = [_prefill_row(p, max_batched) for p in prefill] + [_decode_row(p) for p in decode]
    ys = [p.prefill_s for p in prefill] + [p.step_s for p in decode]
    if min(ys) <= 0:
        raise ConfigError("a probe's measured time is not positive: the engine's histograms did not move")
    a = np.asarray(rows, dtype=float) / np.asarray(ys)[:, None]
    a[:, [i for i, k in enumerate(PARAMS) if k not in params]] = 0.0
    # columns scaled to unit norm so the solver's tolerance treats seconds and seconds/token^2 alike
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    x, _ = nnls(a / norms, np.ones(len(ys)))
    return dict(zip(PARAMS, (float(v) for v in x / norms)))


def fit_frontend(prefill: Sequence[PrefillProbe]) -> tuple[float, float]:
    """``(frontend_overhead_s, frontend_per_token_s)``: the line through the probes' frontend delays
    over prompt length, non-negative."""
    from scipy.optimize import nnls

    a = np.asarray([[1.0, p.new + p.context] for p in prefill])
    y = np.asarray([max(p.frontend_s, 0.0) for p in prefill])
    x, _ = nnls(a, y)
    return float(x[0]), float(x[1])


def predict_prefill(params: Mapping[str, float], p: PrefillProbe, max_batched: int) -> float:
    """The fitted engine prefill time of a probe."""
    row = _prefill_row(p, max_batched)
    return float(sum(params[k] * v for k, v in zip(PARAMS, row)))


def predict_ttft(params: Mapping[str, float], p: PrefillProbe, max_batched: int) -> float:
    """The TTFT the emulator would give the probe alone on an idle engine."""
    return (params["frontend_overhead_s"] + params["frontend_per_token_s"] * (p.new + p.context)
            + predict_prefill(params, p, max_batched))


def predict_step(params: Mapping[str, float], p: DecodeProbe) -> float:
    return float(sum(params[k] * v for k, v in zip(PARAMS, _decode_row(p))))


def _errors(pairs: Sequence[tuple[float, float]]) -> dict[str, Any]:
    rel = [abs(pred - obs) / obs for pred, obs in pairs if obs > 0]
    if not rel:
        return {"n": 0, "mean_abs_rel": math.nan, "max_abs_rel": math.nan}
    return {"n": len(rel), "mean_abs_rel": float(np.mean(rel)), "max_abs_rel": float(np.max(rel))}


def errors(params: Mapping[str, float], prefill: Sequence[PrefillProbe], decode: Sequence[DecodeProbe],
           max_batched: int) -> dict[str, Any]:
    """Relative errors of the fitted profile on ``prefill`` / ``decode`` probes (mean and max of
    |predicted - measured| / measured): engine prefill time, client TTFT, decode step time."""
    return {
        "prefill": _errors([(predict_prefill(params, p, max_batched), p.prefill_s) for p in prefill]),
        "ttft": _errors([(predict_ttft(params, p, max_batched), p.ttft_s) for p in prefill]),
        "decode_step": _errors([(predict_step(params, p), p.step_s) for p in decode]),
    }


def split_held_out(items: Sequence[Any], every: int) -> tuple[list[Any], list[Any]]:
    """Every ``every``-th item (from the second) held back; the rest fitted."""
    fit = [x for i, x in enumerate(items) if i % every != 1]
    held = [x for i, x in enumerate(items) if i % every == 1]
    return fit, held


def _median(vals: Sequence[float]) -> float:
    known = [v for v in vals if not math.isnan(v)]
    return float(np.median(known)) if known else math.nan


def median_of_repeats(prefill: Sequence[PrefillProbe], decode: Sequence[DecodeProbe]
                      ) -> tuple[list[PrefillProbe], list[DecodeProbe]]:
    """One probe per shape (new, context) / (batch, context, tokens): the median of its repeats (over
    passes and engines). A host shared with other work delays single probes by multiples; the median
    keeps those outliers out of a least-squares fit."""
    groups: dict[tuple[int, ...], list[Any]] = {}
    for p in prefill:
        groups.setdefault((0, p.new, p.context), []).append(p)
    for d in decode:
        groups.setdefault((1, d.batch, d.context, d.tokens), []).append(d)
    pre, dec = [], []
    for key, ps in groups.items():
        if key[0] == 0:
            pre.append(PrefillProbe(key[1], key[2], *(_median([getattr(p, f) for p in ps])
                                                       for f in ("prefill_s", "queue_s", "ttft_s", "engine_ttft_s"))))
        else:
            dec.append(DecodeProbe(key[1], key[2], key[3], float(np.median([d.step_s for d in ps]))))
    return pre, dec


def _fit_all(prefill: Sequence[PrefillProbe], decode: Sequence[DecodeProbe], max_batched: int,
             params: Sequence[str]) -> dict[str, float]:
    fitted = fit_steps(prefill, decode, max_batched, params)
    fitted["frontend_overhead_s"], fitted["frontend_per_token_s"] = fit_frontend(prefill)
    return fitted


def leave_one_out_error(prefill: Sequence[PrefillProbe], decode: Sequence[DecodeProbe], max_batched: int,
                        params: Sequence[str] = PARAMS) -> dict[str, Any]:
    """Each shape predicted by a fit of all the others (shapes already medians): an out-of-sample error
    over every probe, not only the few a fixed split holds back."""
    pre, dec = [], []
    for i, p in enumerate(prefill):
        fitted = _fit_all([q for j, q in enumerate(prefill) if j != i], decode, max_batched, params)
        pre.append((predict_prefill(fitted, p, max_batched), p.prefill_s, predict_ttft(fitted, p, max_batched), p.ttft_s))
    for i, d in enumerate(decode):
        fitted = _fit_all(prefill, [q for j, q in enumerate(decode) if j != i], max_batched, params)
        dec.append((predict_step(fitted, d), d.step_s))
    return {"prefill": _errors([(a, b) for a, b, _, _ in pre]), "ttft": _errors([(c, d) for _, _, c, d in pre]),
            "decode_step": _errors(dec)}


def fit_profile(prefill: Sequence[PrefillProbe], decode: Sequence[DecodeProbe], *, max_batched: int,
                hold_out_every: int = 4, params: Sequence[str] = PARAMS) -> dict[str, Any]:
    """Fit on the medians of repeated shapes (:func:`median_of_repeats`), all but every
    ``hold_out_every``-th shape of each kind; returns ``{"params": {...step and frontend params},
    "fit_error": ..., "held_out_error": ..., "loo_error": ..., "probes": counts of shapes}``; the
    profile's parameters are those of this split's fit (``loo_error`` only scores the model)."""
    prefill, decode = median_of_repeats(prefill, decode)
    pf, ph = split_held_out(prefill, hold_out_every)
    df, dh = split_held_out(decode, hold_out_every)
    fitted = _fit_all(pf, df, max_batched, params)
    loo = leave_one_out_error(prefill, decode, max_batched, params) if len(prefill) > 3 and len(decode) > 2 else {}
    return {"params": fitted, "fit_error": errors(fitted, pf, df, max_batched),
            "held_out_error": errors(fitted, ph, dh, max_batched), "loo_error": loo,
            "probes": {"prefill_fit": len(pf), "prefill_held_out": len(ph), "decode_fit": len(df),
                       "decode_held_out": len(dh)}}


def profile_entry(fit: Mapping[str, Any], *, model: str, gpu: str, num_gpu_blocks: int, block_size: int,
                  max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int,
                  kv_bytes_per_token: int | None, sources: Sequence[str]) -> dict[str, Any]:
    """One profile in the ``profiles.json`` format whose KV pool is the engine's ``num_gpu_blocks``
    (null block included, as vLLM counts it) of ``block_size``.

    ``kv_bytes_per_token`` None: the engine does not say it, and only transfer times (offload,
    migration, PD) depend on it; one byte per token is written and the profile's assumptions say so,
    so the pool size in blocks is exact either way.
    """
    per_token = kv_bytes_per_token or 1
    assumptions = []
    if kv_bytes_per_token is None:
        assumptions.append("kv_bytes_per_token unknown (not exported by the engine): 1 byte per token, so the KV "
                           "pool is exact in blocks; transfer and offload times of this profile are meaningless")
    assumptions.append("step and frontend costs: non-negative least squares on relative error over the fit "
                       "probes; fit_error / held_out_error are on probes of each kind (see fit)")
    entry: dict[str, Any] = {
        "model": model, "gpu": gpu, "kv_bytes_per_token": per_token,
        "gpu_kv_capacity_bytes": (num_gpu_blocks - 1) * block_size * per_token,
        "max_model_len": max_model_len, "block_size": block_size,
        "max_num_batched_tokens": max_num_batched_tokens, "max_num_seqs": max_num_seqs,
    }
    entry.update({k: float(f"{v:.4g}") for k, v in fit["params"].items()})
    entry.update(sources=list(sources), assumptions=assumptions,
                 fit={k: fit[k] for k in ("fit_error", "held_out_error", "loo_error", "probes") if k in fit})
    return entry

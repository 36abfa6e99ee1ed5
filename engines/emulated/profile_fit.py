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
Both kinds are fitted together on relative errors (every probe weighs the same however long it
is), then the frontend line on the residual delays. The probes held back from the fit are
predicted with the fitted profile and their relative errors reported, and every shape is also
predicted by a fit without it (leave-one-out), which uses every probe.

Why a robust fit: on a host shared with other work a probe now and then meets a stall (its process
preempted for tens to hundreds of milliseconds) that multiplies its time. Squared error lets one
such probe drag every parameter (one probe at 50x its shape's time moved the frontend delay from 7
to 52 ms); the median of a shape's repeats is no guard when a shape has two of them (their median
is their mean). So every repeat is fitted as its own row with a robust loss: soft-L1 from the
least-squares solution (quadratic for residuals up to :data:`REL_SCALE` of a probe's time, linear
beyond: a stall pulls by its size, not its square), then Cauchy from there (a residual many scales
out hardly pulls at all). Probes at least :data:`STALL_RATIO` times
the fitted prediction are counted as stalls and left out of the reported errors (their count is
reported); :func:`fit_check` flags a fit whose held-out error is far above its fit error or whose
probes stalled too often to trust.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuhit.errors import ConfigError

# soft-L1 scale: residuals below this fraction of a probe's time weigh quadratically, beyond it linearly
REL_SCALE = 0.05
# a probe this many times its fitted prediction met a stall (host preemption), not the step model's cost
STALL_RATIO = 2.0

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
              params: Sequence[str] = PARAMS, robust: bool = True) -> dict[str, float]:
    """The step-time parameters (:data:`PARAMS`), non-negative, minimizing relative error (soft-L1
    with ``robust``, else squared); those not in ``params`` are held at 0 (a smaller model, for
    comparing models on the same probes)."""
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
    an = a / norms
    x, _ = nnls(an, np.ones(len(ys)))
    if robust:
        live = np.flatnonzero(an.any(axis=0))  # a column held at 0 stays out of the robust solve
        x[live] = _soft_l1(an[:, live], np.ones(len(ys)), x[live], REL_SCALE)
    return dict(zip(PARAMS, (float(v) for v in x / norms)))


def _soft_l1(a: np.ndarray, y: np.ndarray, x0: np.ndarray, scale: float) -> np.ndarray:
    """Non-negative ``x`` minimizing a robust loss of ``a @ x - y`` at ``scale``, from ``x0``."""
    from scipy.optimize import least_squares

    if not len(x0):
        return x0
    x = np.maximum(x0, 0.0)
    # soft-L1 (convex: from the least-squares start, however far a stall pulled it), then Cauchy from
    # there (a residual many scales out no longer pulls at all: a stall's pull fades with its size)
    for loss in ("soft_l1", "cauchy"):
        x = least_squares(lambda v: a @ v - y, x, jac=lambda v: a, bounds=(0.0, np.inf), loss=loss, f_scale=scale,
                          method="trf", x_scale="jac").x
        x = np.maximum(x, 0.0)
    return x


def fit_frontend(prefill: Sequence[PrefillProbe], robust: bool = True) -> tuple[float, float]:
    """``(frontend_overhead_s, frontend_per_token_s)``: the line through the probes' frontend delays
    over prompt length, non-negative (soft-L1 with ``robust``, at a scale of a fifth of the median
    delay: a probe whose HTTP path stalled pulls the line by its delay, not its delay squared)."""
    from scipy.optimize import nnls

    a = np.asarray([[1.0, p.new + p.context] for p in prefill])
    y = np.asarray([max(p.frontend_s, 0.0) for p in prefill])
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    x, _ = nnls(a / norms, y)
    if robust and len(y) > 2:
        scale = max(0.2 * float(np.median(y)), 1e-5)
        x = _soft_l1(a / norms, y, x, scale)
    x = x / norms
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


def shapes_of(prefill: Sequence[PrefillProbe], decode: Sequence[DecodeProbe]
              ) -> tuple[list[list[PrefillProbe]], list[list[DecodeProbe]]]:
    """The probes grouped by shape ((new, context) / (batch, context, tokens)), in first-seen order."""
    pre: dict[tuple[int, int], list[PrefillProbe]] = {}
    dec: dict[tuple[int, int, int], list[DecodeProbe]] = {}
    for p in prefill:
        pre.setdefault((p.new, p.context), []).append(p)
    for d in decode:
        dec.setdefault((d.batch, d.context, d.tokens), []).append(d)
    return list(pre.values()), list(dec.values())


def _flat(groups: Sequence[Sequence[Any]]) -> list[Any]:
    return [x for g in groups for x in g]


def _fit_all(prefill: Sequence[Sequence[PrefillProbe]], decode: Sequence[Sequence[DecodeProbe]], max_batched: int,
             params: Sequence[str], robust: bool) -> dict[str, float]:
    """Step and frontend parameters from shapes of probes: every repeat its own row (robust), or the
    shapes' medians by least squares."""
    if robust:
        pre, dec = _flat(prefill), _flat(decode)
    else:
        pre, dec = median_of_repeats(_flat(prefill), _flat(decode))
    fitted = fit_steps(pre, dec, max_batched, params, robust)
    fitted["frontend_overhead_s"], fitted["frontend_per_token_s"] = fit_frontend(pre, robust)
    return fitted


def _typical(pred: float, vals: Sequence[float], robust: bool) -> tuple[float, int]:
    """A shape's measured value to score ``pred`` against: the median of its repeats, those at least
    :data:`STALL_RATIO` x ``pred`` (stalls) left out when ``robust``; and how many were left out."""
    known = [v for v in vals if not math.isnan(v)]
    kept = [v for v in known if not (robust and v >= STALL_RATIO * pred)]
    return (float(np.median(kept)) if kept else math.nan), len(known) - len(kept)


def _score(fits: Sequence[Mapping[str, float]], prefill: Sequence[Sequence[PrefillProbe]],
           decode: Sequence[Sequence[DecodeProbe]], dfits: Sequence[Mapping[str, float]], max_batched: int,
           robust: bool) -> dict[str, Any]:
    """Relative errors (:func:`errors`' kinds) of each prefill shape against ``fits[i]`` and each decode
    shape against ``dfits[i]`` (one fit for all, or one per shape: leave-one-out), with the count of
    probes left out as stalls per kind (``stalled``) and of probes scored (``probes``)."""
    pairs: dict[str, list[tuple[float, float]]] = {"prefill": [], "ttft": [], "decode_step": []}
    stalled = dict.fromkeys(pairs, 0)
    probes = dict.fromkeys(pairs, 0)
    for fitted, shape in zip(fits, prefill):
        for kind, pred, vals in (("prefill", predict_prefill(fitted, shape[0], max_batched), [p.prefill_s for p in shape]),
                                 ("ttft", predict_ttft(fitted, shape[0], max_batched), [p.ttft_s for p in shape])):
            typ, out = _typical(pred, vals, robust)
            pairs[kind].append((pred, typ))
            stalled[kind] += out
            probes[kind] += len(vals)
    for fitted, shape in zip(dfits, decode):
        pred = predict_step(fitted, shape[0])
        typ, out = _typical(pred, [d.step_s for d in shape], robust)
        pairs["decode_step"].append((pred, typ))
        stalled["decode_step"] += out
        probes["decode_step"] += len(shape)
    got: dict[str, Any] = {k: _errors([(a, b) for a, b in v if not math.isnan(b)]) for k, v in pairs.items()}
    for k in pairs:
        got[k].update(stalled=stalled[k], probes=probes[k])
    return got


def leave_one_out_error(prefill: Sequence[PrefillProbe], decode: Sequence[DecodeProbe], max_batched: int,
                        params: Sequence[str] = PARAMS, robust: bool = True) -> dict[str, Any]:
    """Each shape predicted by a fit of all the others: an out-of-sample error over every probe, not
    only the few a fixed split holds back."""
    ps, ds = shapes_of(prefill, decode)
    pfits = [_fit_all(ps[:i] + ps[i + 1:], ds, max_batched, params, robust) for i in range(len(ps))]
    dfits = [_fit_all(ps, ds[:i] + ds[i + 1:], max_batched, params, robust) for i in range(len(ds))]
    return _score(pfits, ps, ds, dfits, max_batched, robust)


def fit_profile(prefill: Sequence[PrefillProbe], decode: Sequence[DecodeProbe], *, max_batched: int,
                hold_out_every: int = 4, params: Sequence[str] = PARAMS, robust: bool = True) -> dict[str, Any]:
    """Fit all but every ``hold_out_every``-th shape of each kind (every repeat of a shape its own row,
    soft-L1; without ``robust``, the shapes' medians by least squares); returns ``{"params": {...step
    and frontend params}, "fit_error": ..., "held_out_error": ..., "loo_error": ..., "probes": counts
    of shapes, "check": :func:`fit_check`}``. Errors are on each shape's median, probes at least
    :data:`STALL_RATIO` x the prediction left out of it and counted (``stalled``); the profile's
    parameters are those of this split's fit (``loo_error`` only scores the model)."""
    ps, ds = shapes_of(prefill, decode)
    pf, ph = split_held_out(ps, hold_out_every)
    df, dh = split_held_out(ds, hold_out_every)
    fitted = _fit_all(pf, df, max_batched, params, robust)
    loo = (leave_one_out_error(prefill, decode, max_batched, params, robust)
           if len(ps) > 3 and len(ds) > 2 else {})
    out = {"params": fitted, "robust": robust,
           "fit_error": _score([fitted] * len(pf), pf, df, [fitted] * len(df), max_batched, robust),
           "held_out_error": _score([fitted] * len(ph), ph, dh, [fitted] * len(dh), max_batched, robust),
           "loo_error": loo,
           "probes": {"prefill_fit": len(pf), "prefill_held_out": len(ph), "decode_fit": len(df),
                      "decode_held_out": len(dh)}}
    out["check"] = fit_check(out)
    return out


# a fit is flagged when its out-of-sample error exceeds FAR x its fit error plus SLACK, when it misses
# its own probes by more than MAX_FIT_ERROR, or when more than MAX_STALLED of a kind's probes stalled
FAR, SLACK, MAX_FIT_ERROR, MAX_STALLED = 2.0, 0.05, 0.25, 0.25


def fit_check(fit: Mapping[str, Any]) -> dict[str, Any]:
    """``{"ok": bool, "reasons": [...]}``: whether the fit's errors say it can be trusted. A host
    stall that corrupted a parameter shows as an out-of-sample error far above the fit error, or as
    a fit that misses its own probes; a host that stalled a large share of the probes was too busy
    for any fit to stand for its engines' typical step."""
    reasons = []
    fe = fit.get("fit_error") or {}
    for kind, e in fe.items():
        if e.get("n") and e["mean_abs_rel"] > MAX_FIT_ERROR:
            reasons.append(f"{kind}: fit error {e['mean_abs_rel']:.0%} above {MAX_FIT_ERROR:.0%}")
        for which in ("held_out_error", "loo_error"):
            o = (fit.get(which) or {}).get(kind) or {}
            if o.get("n") and e.get("n") and o["mean_abs_rel"] > FAR * e["mean_abs_rel"] + SLACK:
                reasons.append(f"{kind}: {which.replace('_', ' ')} {o['mean_abs_rel']:.0%} far above the fit "
                               f"error {e['mean_abs_rel']:.0%}")
        n = e.get("probes", 0) + ((fit.get("held_out_error") or {}).get(kind) or {}).get("probes", 0)
        s = e.get("stalled", 0) + ((fit.get("held_out_error") or {}).get(kind) or {}).get("stalled", 0)
        if n and s / n > MAX_STALLED:
            reasons.append(f"{kind}: {s} of {n} probes stalled (>= {STALL_RATIO:g}x the fit)")
    return {"ok": not reasons, "reasons": reasons}


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
    assumptions.append("step and frontend costs: non-negative soft-L1 regression on relative error over every "
                       "repeat of the fit probes" if fit.get("robust", True) else
                       "step and frontend costs: non-negative least squares on relative error over the fit "
                       "probes' medians")
    assumptions.append("fit_error / held_out_error / loo_error are on each probe shape's median, stalled probes "
                       f"(>= {STALL_RATIO:g}x the prediction) left out and counted; fit.check says whether to trust it")
    entry: dict[str, Any] = {
        "model": model, "gpu": gpu, "kv_bytes_per_token": per_token,
        "gpu_kv_capacity_bytes": (num_gpu_blocks - 1) * block_size * per_token,
        "max_model_len": max_model_len, "block_size": block_size,
        "max_num_batched_tokens": max_num_batched_tokens, "max_num_seqs": max_num_seqs,
    }
    entry.update({k: float(f"{v:.4g}") for k, v in fit["params"].items()})
    entry.update(sources=list(sources), assumptions=assumptions,
                 fit={k: fit[k] for k in ("fit_error", "held_out_error", "loo_error", "probes", "check", "robust")
                      if k in fit})
    return entry

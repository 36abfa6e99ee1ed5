#!/usr/bin/env python3
"""Device check of the NVSHMEM route-the-query transport against the real nvshmem4py: one PE routes to itself.

Run from the repository root on one CUDA GPU, with nvshmem4py importable (carried as a wheel)::

    PYTHONPATH=.:/tmp/site OMP_NUM_THREADS=1 python3 tests/perf/gpu_nvshmem_check.py --out $OUT
    PYTHONPATH=. python3 tests/perf/gpu_nvshmem_check.py --out DIR --fake   # CPU, through fake_nvshmem
    python3 tests/perf/gpu_nvshmem_check.py --print-fallbacks .whl/fallback  # wheels the image lacks

(``OMP_NUM_THREADS=1``: with torch's 16 intra-op threads the host-side tensor work of a message above
~130 KB cost ~6-7 ms more a round trip on the H100 host; see the transport's docstring.)

Steps (each in its own try/except; a failure is recorded with its traceback, the rest still runs where
it can; ``nvshmem-check.json`` is rewritten after every step, so a timeout still leaves what was done):

- ``init``: ``nvshmem.core`` via :func:`load_nvshmem_core` and :func:`init_uid` (rank 0 of 1), the
  library's own version report; ``--fake``: a one-PE :class:`FakeNvshmemWorld`.
- ``build``: an :class:`NvshmemPE`, a :class:`Holder` with three MLA chunks (48 tokens, like the
  fake-based tests' ``cluster``) resident on the GPU, its :class:`NvshmemHolderService`, and an
  :class:`NvshmemQueryTransport` whose only holder is this PE.
- ``correctness``: the routed partial (fp32 wire, causal rows) against the in-process Holder's answer
  (max-abs of o, m, l; exact equality recorded), the o of all chunks against float64 reference
  attention, and a bf16 wire against :class:`InProcessTransport` with the same bf16 codec.
- ``error_reply``: a chunk that is not resident comes back as the transport's TransferError (the
  holder's error reply, not a timeout); an oversize request fails on the send side; the slot works after.
- ``put_signal``: the bare ``put_signal + quiet + stream sync`` per slot size (nvshmem4py moves the
  whole slot, ``min(dst, src)`` bytes of the allocations).
- ``timing``: round trips (send / holder serve / receive, each timed) for GQA (32q/8kv, d 128) and
  absorbed MLA (16 and 128 heads, d_qk 576, d_v 512) shapes from ``engines.attention.shapes``, bf16
  wire and cache, over query rows and chunk sizes; median/min over ``--reps`` after ``--warmup``, next
  to the holder's compute alone and the in-process bf16-wire route (codec + compute, no NVSHMEM).
  Bytes per message (request and reply, header included) and the slot size moved are recorded.
- ``finalize``: every PE closed (collective frees) and ``nvshmem.core.finalize()``.

Exit status: 0 all steps passed, 3 the init step failed (the device command may retry with other
NVSHMEM settings), 1 another step failed. Timings are host wall-clock (``perf_counter``): this
transport is host-driven, every step ends in a host synchronization, so wall-clock is what a caller
sees. Under ``--fake`` the numbers are meaningless (CPU, in-process copies); it checks the script.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pathlib
import sys
import time
import traceback
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

OUT_NAME = "nvshmem-check.json"
# Single PE on one GPU: no remote transport is needed, and a UID bootstrap over loopback works on a
# machine without a network. Only defaults: the caller's environment wins.
NVSHMEM_ENV_DEFAULTS = {"NVSHMEM_REMOTE_TRANSPORT": "none", "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo"}
# what nvshmem4py-cu13 0.4.1 requires of packages the device image may hold in an older version
FALLBACKS = {"cuda-core": ((0, 5, 0), "cuda_core-*.whl"), "cuda-pathfinder": ((1, 2, 3), "cuda_pathfinder-*.whl")}

SCALES = {"gqa-32q8kv": 128**-0.5, "mla-dsv2-lite": 192**-0.5, "mla-128h": 192**-0.5}
SLOT_MIN = 64 * 1024
SLOT_MAX = 64 * 1024 * 1024  # 4 slots of each size live on the symmetric heap (1 GiB by default)


def _vtuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def print_fallbacks(folder: str) -> int:
    """Print the fallback wheels (in ``folder``) for packages missing or older than nvshmem4py needs."""
    import importlib.metadata as md

    need = []
    for name, (minimum, pattern) in FALLBACKS.items():
        try:
            have = _vtuple(md.version(name))
        except md.PackageNotFoundError:
            have = (0,)
        if have < minimum:
            need += sorted(glob.glob(os.path.join(folder, pattern)))
    print(" ".join(need))
    return 0


def _pkg_versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in ("nvshmem4py-cu13", "nvshmem4py-cu12", "nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12", "cuda-core",
                 "cuda-bindings", "cuda-pathfinder", "numpy", "torch"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def env_info(torch: Any, fake: bool) -> dict:
    """gpu_measure's environment block (date, versions, device) plus what this check depends on."""
    from tests.perf.gpu_measure import env_info as device_env

    info = device_env(torch)
    info.update(mode="fake (CPU, engines.attention.fake_nvshmem)" if fake else "real nvshmem4py",
                packages=_pkg_versions(),
                nvshmem_env={k: v for k, v in sorted(os.environ.items()) if k.startswith("NVSHMEM_")},
                pythonpath=os.environ.get("PYTHONPATH", ""))
    if "device" not in info:
        info["device"] = "cpu"
    return info


def _stats(times_s: list[float]) -> dict:
    t = sorted(x * 1e6 for x in times_s)
    if not t:
        return {"reps": 0}
    return {"median_us": round(t[len(t) // 2], 2), "min_us": round(t[0], 2), "max_us": round(t[-1], 2), "reps": len(t)}


class _OnDevice:
    """A Holder seen through the in-process transport's byte codec, which decodes q onto the host:
    moves each decoded request to the holder's device first, as the NVSHMEM service does."""

    def __init__(self, holder: Any, device: Any):
        self.holder = holder
        self.device = device

    def answer(self, req: Any) -> Any:
        from engines.attention.nvshmem_transport import _on_device

        return self.holder.answer(_on_device(req, self.device))


def _slot_for(nbytes: int) -> int:
    s = SLOT_MIN
    while s < nbytes:
        s *= 2
    return s


class Check:
    """Holds the JSON, the objects that steps share, and the step runner."""

    def __init__(self, args: argparse.Namespace):
        import torch

        self.args = args
        self.torch = torch
        self.fake = args.fake
        self.dev = torch.device("cpu" if args.fake else "cuda")
        self.t0 = time.perf_counter()
        self.out_dir = pathlib.Path(args.out)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / OUT_NAME
        self.res: dict = {"env": env_info(torch, args.fake), "config": {k: v for k, v in vars(args).items()},
                          "steps": {}, "errors": {}, "step_s": {}, "passed": {}}
        self.core: Any = None
        self.world: Any = None
        self.pes: list[Any] = []  # every NvshmemPE still open (closed in finalize)
        self.pe: Any = None
        self.holder: Any = None
        self.service: Any = None
        self.transport: Any = None
        self.data: dict = {}

    def left(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.t0)

    def write(self) -> None:
        self.res["elapsed_s"] = round(time.perf_counter() - self.t0, 2)
        self.path.write_text(json.dumps(self.res, indent=1, default=str))

    def step(self, name: str, fn: Any) -> bool:
        t0 = time.perf_counter()
        print(f"[nvshmem-check] {name} (budget left {self.left():.0f}s)", flush=True)
        ok = True
        try:
            out = fn()
            self.res["steps"][name] = out if out is not None else {}
        except Exception:  # noqa: BLE001 - a failed step is recorded, the rest still runs
            ok = False
            self.res["errors"][name] = traceback.format_exc()[-3000:]
            print(self.res["errors"][name], flush=True)
        self.res["passed"][name] = ok
        self.res["step_s"][name] = round(time.perf_counter() - t0, 3)
        self.write()
        return ok

    # --------------------------------------------------------------------------------------------
    def sync(self) -> None:
        if self.dev.type == "cuda":
            self.torch.cuda.synchronize()

    def new_pe(self, slot_bytes: int) -> Any:
        """A new NvshmemPE (collective). Each gets one transport and one service: sequence numbers are
        per transport and the service remembers the last one served, so they must not be mixed."""
        from engines.attention.nvshmem_transport import NvshmemPE

        pe = NvshmemPE(self.core, slot_bytes=slot_bytes)
        self.pes.append(pe)
        return pe

    def close_pe(self, pe: Any) -> None:
        if pe in self.pes:
            self.pes.remove(pe)
        pe.close()

    # --- steps ----------------------------------------------------------------------------------
    def step_init(self) -> dict:
        if self.fake:
            from engines.attention.fake_nvshmem import FakeNvshmemWorld

            self.world = FakeNvshmemWorld(1)
            self.core = self.world.core(0)
            return {"my_pe": self.core.my_pe(), "n_pes": self.core.n_pes()}
        from engines.attention.nvshmem_lib import init_uid, load_nvshmem_core

        t0 = time.perf_counter()
        core = load_nvshmem_core()
        t_import = time.perf_counter() - t0
        out: dict = {"import_s": round(t_import, 3)}
        try:
            import nvshmem

            out["nvshmem4py_version"] = nvshmem.__version__
            out["nvshmem4py_file"] = nvshmem.__file__
            v = core.get_version()
            out["libnvshmem_version"] = v.libnvshmem_version
            out["openshmem_spec_version"] = v.openshmem_spec_version
        except Exception as exc:  # noqa: BLE001 - optional report
            out["version_error"] = f"{type(exc).__name__}: {exc}"
        try:
            import cuda.core

            out["cuda_core_file"] = cuda.core.__file__
        except Exception as exc:  # noqa: BLE001 - optional report
            out["cuda_core_error"] = f"{type(exc).__name__}: {exc}"
        t0 = time.perf_counter()
        init_uid(core, rank=0, nranks=1)
        out["init_s"] = round(time.perf_counter() - t0, 3)
        self.core = core
        out["my_pe"], out["n_pes"] = int(core.my_pe()), int(core.n_pes())
        assert out["my_pe"] == 0 and out["n_pes"] == 1, out
        return out

    def step_build(self) -> dict:
        from engines.attention.nvshmem_transport import NvshmemHolderService, NvshmemQueryTransport
        from engines.attention.partial import mla_kv
        from engines.attention.transports import Holder

        torch, dev = self.torch, self.dev
        # the fake-based tests' cluster(): 48 MLA tokens, fp32, chunks of 5/5/7/8/7/8 tokens on one holder
        gen = torch.Generator().manual_seed(11)
        k, v = mla_kv(torch.randn(48, 576, generator=gen))
        pos = torch.arange(48)
        q = torch.randn(4, 8, 576, generator=gen)
        q_pos = torch.tensor([5, 30, 44, 47])
        bounds = [0, 5, 10, 17, 25, 32, 40, 48]
        h = Holder("h0")
        for i in range(len(bounds) - 1):
            a, b = bounds[i], bounds[i + 1]
            h.add_chunk(f"c{i}", k[a:b].to(dev), v[a:b].to(dev), pos[a:b].to(dev))
        self.holder = h
        self.data = {"k": k, "v": v, "pos": pos, "q": q.to(dev), "q_pos": q_pos.to(dev)}
        slot = 256 * 1024
        t0 = time.perf_counter()
        self.pe = self.new_pe(slot)
        t_pe = time.perf_counter() - t0
        self.service = NvshmemHolderService(h, self.pe)
        self.transport = NvshmemQueryTransport({"self": self.pe.my_pe}, pe=self.pe, pump=self.service.serve_once,
                                               max_pumps=100_000)
        return {"slot_bytes": slot, "pe_build_s": round(t_pe, 4), "chunks": list(h.chunk_ids),
                "heap_device": str(self.pe.inbox[0].device), "my_pe": self.pe.my_pe, "n_pes": self.pe.n_pes}

    def step_correctness(self) -> dict:
        from engines.attention.partial import reference_attention
        from engines.attention.transports import InProcessTransport
        from engines.attention.wire import RouteRequest

        torch, t, h, d = self.torch, self.transport, self.holder, self.data
        if t is None:
            raise RuntimeError("build step failed: nothing to route")
        scale = SCALES["mla-dsv2-lite"]
        out: dict = {}
        # fp32 wire, causal rows, every chunk
        req = RouteRequest(d["q"], scale, None, d["q_pos"])
        got = t.route("self", req)
        want = h.answer(req)
        diffs = {n: float((getattr(got, n).double() - getattr(want, n).cpu().double()).abs().max()) for n in ("o", "m", "l")}
        exact = all(torch.equal(getattr(got, n), getattr(want, n).cpu()) for n in ("o", "m", "l"))
        ref = reference_attention(d["q"].cpu().double(), d["k"].double(), d["v"].double(), scale=scale,
                                  mask=d["pos"][None, :] <= d["q_pos"].cpu()[:, None])
        ref_diff = float((got.o.double() - ref).abs().max())
        out["fp32_all_chunks"] = {"maxabs_vs_holder": diffs, "exact_vs_holder": exact, "o_maxabs_vs_float64_reference": ref_diff,
                                  "bytes_sent": t.stats.bytes_sent, "bytes_received": t.stats.bytes_received}
        assert max(diffs.values()) <= 1e-5, diffs
        assert ref_diff <= 1e-4, ref_diff
        # a chunk subset
        sub = RouteRequest(d["q"][:2], scale, ("c1", "c4"), d["q_pos"][:2])
        got_s, want_s = t.route("self", sub), h.answer(sub)
        sub_diff = float((got_s.o.double() - want_s.o.cpu().double()).abs().max())
        out["fp32_chunk_subset"] = {"o_maxabs_vs_holder": sub_diff, "exact": bool(torch.equal(got_s.o, want_s.o.cpu()))}
        assert sub_diff <= 1e-5, sub_diff
        # bf16 wire (same transport: its sequence numbers go on), against the in-process transport's
        # bf16 codec: the same bytes must come back
        sent0, recv0 = t.stats.bytes_sent, t.stats.bytes_received
        t.wire_dtype = self.service.wire_dtype = torch.bfloat16
        try:
            got_b = t.route("self", req)
        finally:
            t.wire_dtype = self.service.wire_dtype = None
        ip = InProcessTransport({"self": _OnDevice(h, self.dev)}, wire_dtype=torch.bfloat16)
        want_b = ip.route("self", req)
        bdiff = float((got_b.o.double() - want_b.o.cpu().double()).abs().max())
        b_sent, b_recv = t.stats.bytes_sent - sent0, t.stats.bytes_received - recv0
        out["bf16_wire"] = {"o_maxabs_vs_in_process_wire": bdiff, "exact": bool(torch.equal(got_b.o, want_b.o.cpu())),
                            "o_maxabs_vs_float64_reference": float((got_b.o.double() - ref).abs().max()),
                            "bytes_sent": b_sent, "bytes_received": b_recv,
                            "in_process_bytes_sent": ip.stats.bytes_sent, "in_process_bytes_received": ip.stats.bytes_received}
        assert bdiff <= 1e-5, bdiff
        assert b_sent == ip.stats.bytes_sent + 24 and b_recv == ip.stats.bytes_received + 24, (b_sent, b_recv)
        out["service"] = {"served": self.service.served, "errors": self.service.errors}
        out["transport_failures"] = t.stats.failures
        assert out["transport_failures"] == 0 and self.service.errors == 0
        return out

    def step_error_reply(self) -> dict:
        from engines.attention.wire import RouteRequest
        from gpuhit.errors import TransferError

        torch, t, d = self.torch, self.transport, self.data
        if t is None:
            raise RuntimeError("build step failed: nothing to route")
        scale = SCALES["mla-dsv2-lite"]
        out: dict = {}
        errors_before, failures_before = self.service.errors, t.stats.failures
        t0 = time.perf_counter()
        try:
            t.route("self", RouteRequest(d["q"], scale, ("nope",)))
        except TransferError as exc:
            msg = str(exc)
        else:
            raise AssertionError("a request for a chunk that is not resident was answered")
        out["missing_chunk"] = {"error": msg, "seconds": round(time.perf_counter() - t0, 4),
                                "service_errors": self.service.errors - errors_before}
        assert "NotFoundError" in msg and "chunks not resident" in msg, msg
        assert self.service.errors == errors_before + 1 and t.stats.failures == failures_before + 1
        # a request larger than the slot fails on the send side, nothing is put
        big = torch.zeros(64, 8, 576, device=self.dev)
        try:
            t.send("self", RouteRequest(big, scale))
        except TransferError as exc:
            out["oversize_request"] = {"error": str(exc)}
        else:
            raise AssertionError("an oversize request was sent")
        assert "does not fit" in out["oversize_request"]["error"]
        # the reply slot is free again: a good request works
        req = RouteRequest(d["q"], scale, None, d["q_pos"])
        got = t.route("self", req)
        ok = bool(torch.equal(got.o, self.holder.answer(req).o.cpu()))
        out["after_errors_route_ok"] = ok
        assert ok
        return out

    def step_put_signal(self) -> dict:
        out = []
        for slot in self.args.put_slots:
            if self.left() < 10:
                out.append({"slot_bytes": slot, "skipped": "budget"})
                continue
            # a PE of its own: the signal value 0 never counts as a request to any service
            pe = self.new_pe(slot)
            try:
                me = pe.my_pe
                times = []
                for i in range(self.args.warmup + self.args.reps):
                    t0 = time.perf_counter()
                    pe.lib.put_signal(pe.inbox[me], pe.out_req, pe.inbox_sig[me], 0, me)
                    if i >= self.args.warmup:
                        times.append(time.perf_counter() - t0)
                st = _stats(times)
                st["slot_bytes"] = slot
                if st.get("median_us"):
                    st["GB_per_s_at_median"] = round(slot / (st["median_us"] * 1e-6) / 1e9, 3)
                out.append(st)
            finally:
                self.close_pe(pe)
            self.write()
        return {"points": out, "what": "put_signal + quiet + stream synchronize, one slot, to this PE"}

    def step_timing(self) -> dict:
        from engines.attention.nvshmem_transport import _HDR, NvshmemHolderService, NvshmemQueryTransport
        from engines.attention.partial import mla_kv
        from engines.attention.shapes import GQA_LLAMA8B, MLA_DSV2_LITE, MLA_FRONTIER
        from engines.attention.transports import Holder, InProcessTransport
        from engines.attention.wire import RouteRequest, encode_partial, encode_request

        torch, dev, args = self.torch, self.dev, self.args
        bf16 = torch.bfloat16
        shapes = {s.name: s for s in (GQA_LLAMA8B, MLA_DSV2_LITE, MLA_FRONTIER)}
        points = []
        res = {"points": points, "wire_dtype": "bfloat16", "cache_dtype": "bfloat16", "holder_upcast_fp32": True,
               "note": "rt = send + serve + receive, host wall-clock; fabric bytes per rt = 2 x slot_bytes"}
        self.res["steps"]["timing"] = res
        # plan every point, then run them grouped by slot size (one NvshmemPE per size, closed after)
        plan = []
        for sname in args.shapes:
            s = shapes[sname]
            for ct in args.chunks:
                for mq in args.rows:
                    q_bytes = mq * s.n_q_heads * s.d_qk * 2
                    req_bytes = _HDR.size + len(encode_request(RouteRequest(torch.zeros(1, 1, 1), 1.0))) - 4 + q_bytes
                    rep_bytes = _HDR.size + 17 + mq * s.n_q_heads * (s.d_v * 2 + 8)
                    plan.append((_slot_for(max(req_bytes, rep_bytes)), sname, ct, mq))
        plan.sort()
        kv_cache: dict = {}
        cur: dict = {}  # the open slot size's pe, service and transport
        for slot, sname, ct, mq in plan:
            s = shapes[sname]
            rec: dict = {"shape": sname, "n_q_heads": s.n_q_heads, "n_kv_heads": s.n_kv_heads, "d_qk": s.d_qk,
                         "d_v": s.d_v, "chunk_tokens": ct, "mq": mq, "slot_bytes": slot}
            points.append(rec)
            if slot > SLOT_MAX:
                rec["skipped"] = f"slot {slot} B > {SLOT_MAX} B"
                continue
            if self.left() < 5:
                rec["skipped"] = "budget"
                continue
            try:
                if cur.get("slot") != slot:
                    if cur:
                        self.close_pe(cur.pop("pe"))
                        cur.clear()
                    pe = self.new_pe(slot)
                    svc = NvshmemHolderService(Holder("placeholder"), pe, wire_dtype=bf16)
                    tr = NvshmemQueryTransport({"self": pe.my_pe}, pe=pe, wire_dtype=bf16, max_pumps=1000)
                    cur.update(slot=slot, pe=pe, svc=svc, tr=tr)
                svc, tr = cur["svc"], cur["tr"]
                key = (sname, ct)
                if key not in kv_cache:
                    kv_cache.clear()
                    torch.manual_seed(0)
                    if s.latent:
                        k, v = mla_kv(torch.randn(ct, s.d_qk, device=dev, dtype=bf16), s.d_v)
                    else:
                        k = torch.randn(ct, s.n_kv_heads, s.d_qk, device=dev, dtype=bf16)
                        v = torch.randn(ct, s.n_kv_heads, s.d_v, device=dev, dtype=bf16)
                    kv_cache[key] = (k, v)
                k, v = kv_cache[key]
                h = Holder(f"{sname}-{ct}")
                h.add_chunk("c", k, v)
                svc.holder = h
                before = (tr.stats.requests, tr.stats.bytes_sent, tr.stats.bytes_received, tr.stats.failures, svc.errors)
                q = torch.randn(mq, s.n_q_heads, s.d_qk, device=dev, dtype=bf16)
                req = RouteRequest(q, SCALES[sname], None)
                rec["request_bytes"] = _HDR.size + len(encode_request(req, bf16))
                rec["reply_bytes"] = _HDR.size + len(encode_partial(h.answer(req), bf16))
                rec["bytes_per_row_head"] = {"q": s.query_row_bytes(), "partial": s.partial_row_bytes()}
                snd, srv, rcv, rt = [], [], [], []
                n_time = max(1, args.reps)
                t_point = time.perf_counter()
                for i in range(args.warmup + n_time):
                    t0 = time.perf_counter()
                    seq = tr.send("self", req)
                    t1 = time.perf_counter()
                    served = svc.serve_once()
                    t2 = time.perf_counter()
                    got = tr.receive(seq)
                    polls = 0
                    while got is None:  # the puts are synchronous here; this loop is a guard only
                        polls += 1
                        if polls > 1000:
                            raise RuntimeError(f"no reply for seq {seq} after 1000 polls")
                        svc.serve_once()
                        got = tr.receive(seq)
                    t3 = time.perf_counter()
                    if i >= args.warmup:
                        snd.append(t1 - t0)
                        srv.append(t2 - t1)
                        rcv.append(t3 - t2)
                        rt.append(t3 - t0)
                    if served != 1:
                        raise RuntimeError(f"serve_once served {served} requests, expected 1")
                    if time.perf_counter() - t_point > args.point_s and len(rt) >= 5:
                        break
                # correctness of the last reply against the holder (bf16 wire both ways)
                want = InProcessTransport({"h": _OnDevice(h, dev)}, wire_dtype=bf16).route("h", req)
                rec["o_maxabs_vs_in_process_wire"] = float((got.o.double() - want.o.cpu().double()).abs().max())
                rec["rt"] = _stats(rt)
                rec["send"] = _stats(snd)
                rec["serve"] = _stats(srv)
                rec["receive"] = _stats(rcv)
                # the same request without NVSHMEM: holder compute alone, and the in-process bf16 wire route
                comp, inproc = [], []
                ip = InProcessTransport({"h": _OnDevice(h, dev)}, wire_dtype=bf16)
                for i in range(args.warmup + len(rt)):
                    t0 = time.perf_counter()
                    h.answer(req)
                    self.sync()
                    t1 = time.perf_counter()
                    ip.route("h", req)
                    self.sync()
                    t2 = time.perf_counter()
                    if i >= args.warmup:
                        comp.append(t1 - t0)
                        inproc.append(t2 - t1)
                rec["holder_compute"] = _stats(comp)
                rec["in_process_wire_route"] = _stats(inproc)
                if rec["rt"].get("median_us") and rec["in_process_wire_route"].get("median_us"):
                    rec["nvshmem_overhead_median_us"] = round(rec["rt"]["median_us"] - rec["in_process_wire_route"]["median_us"], 2)
                after = (tr.stats.requests, tr.stats.bytes_sent, tr.stats.bytes_received, tr.stats.failures, svc.errors)
                names = ("requests", "bytes_sent", "bytes_received", "failures", "holder_errors")
                rec["stats"] = {n: a - b for n, a, b in zip(names, after, before, strict=True)}
                assert rec["stats"]["failures"] == 0 and rec["stats"]["holder_errors"] == 0, rec["stats"]
                assert rec["stats"]["bytes_sent"] == rec["stats"]["requests"] * rec["request_bytes"]
                assert rec["stats"]["bytes_received"] == rec["stats"]["requests"] * rec["reply_bytes"]
                assert rec["o_maxabs_vs_in_process_wire"] <= 1e-5, rec["o_maxabs_vs_in_process_wire"]
            except Exception:  # noqa: BLE001 - one failing point is recorded, the others still run
                rec["error"] = traceback.format_exc()[-1500:]
                res.setdefault("failed_points", 0)
                res["failed_points"] += 1
            print(f"[nvshmem-check]   {sname} ct={ct} mq={mq} slot={slot}: "
                  f"rt {rec.get('rt', {}).get('median_us')} us, in-process {rec.get('in_process_wire_route', {}).get('median_us')} us"
                  f"{' ERROR' if 'error' in rec else ''}", flush=True)
            self.write()
        if cur:
            self.close_pe(cur["pe"])
        kv_cache.clear()
        if res.get("failed_points"):
            raise RuntimeError(f"{res['failed_points']} timing point(s) failed; see their 'error'")
        return res

    def step_finalize(self) -> dict:
        out: dict = {}
        for pe in list(self.pes):
            self.close_pe(pe)
        out["pes_closed"] = True
        if self.fake:
            heaps = self.world.heaps[0]
            out["fake_heap_all_freed"] = all(x is None for x in heaps)
            assert out["fake_heap_all_freed"]
        elif self.core is not None:
            self.sync()
            t0 = time.perf_counter()
            self.core.finalize()
            out["finalize_s"] = round(time.perf_counter() - t0, 3)
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="output directory (default $OUT or .)")
    ap.add_argument("--fake", action="store_true", help="CPU through engines.attention.fake_nvshmem (checks the script)")
    ap.add_argument("--print-fallbacks", metavar="DIR", default=None,
                    help="print the wheels in DIR for packages older than nvshmem4py needs, then exit")
    ap.add_argument("--reps", type=int, default=None, help="timed round trips per point (50; --fake 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed round trips first (5; --fake 1)")
    ap.add_argument("--budget-s", type=float, default=150.0, help="wall-clock budget; later points are skipped")
    ap.add_argument("--point-s", type=float, default=6.0, help="stop a timing point's reps after this long (>= 5 reps)")
    ap.add_argument("--shapes", default="gqa-32q8kv,mla-dsv2-lite,mla-128h")
    ap.add_argument("--rows", default=None, help="query rows per request (1,16,128; --fake 1,4)")
    ap.add_argument("--chunks", default=None, help="chunk tokens (512,4096; --fake 64)")
    ap.add_argument("--no-env-defaults", action="store_true", help=f"do not default {sorted(NVSHMEM_ENV_DEFAULTS)}")
    ap.add_argument("--put-slots", default="65536,1048576,16777216", help="slot sizes for the bare put_signal timing")
    args = ap.parse_args(argv)
    if args.print_fallbacks is not None:
        return print_fallbacks(args.print_fallbacks)
    args.reps = args.reps if args.reps is not None else (3 if args.fake else 50)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.fake else 5)
    args.rows = [int(x) for x in (args.rows or ("1,4" if args.fake else "1,16,128")).split(",")]
    args.chunks = [int(x) for x in (args.chunks or ("64" if args.fake else "512,4096")).split(",")]
    args.shapes = [x.strip() for x in args.shapes.split(",") if x.strip()]
    args.put_slots = [int(x) for x in args.put_slots.split(",")]
    unknown = [s for s in args.shapes if s not in SCALES]
    if unknown:
        ap.error(f"unknown shapes {unknown}; known: {sorted(SCALES)}")
    if not args.fake and not args.no_env_defaults:
        for k, v in NVSHMEM_ENV_DEFAULTS.items():
            os.environ.setdefault(k, v)
    import torch

    if not args.fake and not torch.cuda.is_available():
        raise SystemExit("gpu_nvshmem_check: no CUDA device (torch.cuda.is_available() is False); use --fake on CPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    c = Check(args)
    c.write()
    if not c.step("init", c.step_init):
        c.res["verdict"] = "init failed"
        c.write()
        return 3
    ok = c.step("build", c.step_build)
    if ok:
        c.step("correctness", c.step_correctness)
        c.step("error_reply", c.step_error_reply)
    c.step("put_signal", c.step_put_signal)
    c.step("timing", c.step_timing)
    c.step("finalize", c.step_finalize)
    c.res["verdict"] = "pass" if all(c.res["passed"].values()) and not c.res["errors"] else "fail"
    c.write()
    print(f"[nvshmem-check] {c.res['verdict']}: wrote {c.path} ({c.res['elapsed_s']}s)", flush=True)
    return 0 if c.res["verdict"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())

"""Where a replay's independent runs execute: local worker processes (the default) or a Ray cluster.

A *job* (:mod:`replayer.runs`) is the dict a command builds per run: its :class:`~replayer.cli_replay.RunSpec`,
its ``index`` in the plan, the ``records`` CSV and ``result`` JSON paths of the results folder, and
the simulation options. Each executor is a generator that yields ``(index, result)`` as runs finish
(in completion order), after the run's ``records/<run>.csv`` and ``runs/<run>.json`` are on the
driver's disk, so an interrupted sweep keeps every finished run and ``--resume`` works the same
whichever executor ran it. Traces are passed as ``{key: Trace}``; a job names its trace by
``job.get("trace_key", "")`` (a sweep over Zipf skews replays several traces).

:func:`run_local` forks worker processes that inherit the traces (never pickled). :func:`run_ray`
runs each job as a Ray task (``ray`` is the optional ``gpuhit[ray]`` extra, imported only here and
only when asked):

- each trace is put into Ray's object store once (``ray.put``) and every task reads it from there,
  so nothing re-reads or re-parses the trace files, and worker nodes need no copy of them;
- a task simulates into a private temporary file and returns the CSV bytes, which the driver writes
  into the results folder, so a task on another node writes nothing remote and the record files are
  byte-identical to the local executor's (the simulation is deterministic for a seed);
- a task whose worker process dies (killed, out of memory, node lost) is retried by Ray up to
  ``max_retries`` times; a run's result is written once, keyed by its index, so a retry that
  delivers twice is dropped, never counted twice;
- progress (requests done per run) flows back through a small Ray actor that the driver drains
  between ``ray.wait`` calls into the same progress display as the local pool's.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pathlib
import queue
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Self

from gpuhit.errors import GpuhitError, UnavailableError

# How often the driver wakes to forward progress while waiting for Ray tasks (seconds of wall time;
# a display rate, nothing is computed from it).
_PROGRESS_POLL_S = 0.25
DEFAULT_MAX_RETRIES = 3

_LOCAL_TRACES: Mapping[str, Any] = {}  # set in the parent before forking (inherited, never pickled)
_LOCAL_Q: Any = None

Task = Callable[[dict[str, Any], Any, Any], tuple[int, dict[str, Any], bytes]]


def require_ray() -> Any:
    """The ``ray`` module, or :class:`~gpuhit.errors.UnavailableError` saying how to install it."""
    try:
        import ray
    except ModuleNotFoundError as exc:
        if exc.name != "ray":
            raise
        raise UnavailableError("--ray needs Ray, which is not installed: pip install 'gpuhit[ray]' "
                               "(or pip install ray)") from None
    return ray


# ---------------------------------------------------------------------------------------- local

class InterruptLatch:
    """Ctrl-C that is not lost while runs execute in this process.

    Why: a KeyboardInterrupt raised while the interpreter runs a weakref callback or a ``__del__``
    (asyncio's WeakSet of tasks, for one, which a simulated run fills and empties per request) is
    printed as "Exception ignored" and dropped: the replay then ran on to its end and exited 0. While
    entered (in the main thread, where the default handler is in place), SIGINT raises
    KeyboardInterrupt as the default handler does and is also remembered; :meth:`check`, called
    between runs, raises it again if it was swallowed.
    """

    def __init__(self) -> None:
        self.hit = False
        self._prev: Any = None

    def __enter__(self) -> Self:
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self._prev = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._prev is not None:
            signal.signal(signal.SIGINT, self._prev)
            self._prev = None

    def _on_sigint(self, signum: int, frame: Any) -> None:
        self.hit = True
        raise KeyboardInterrupt

    def check(self) -> None:
        """Raise the Ctrl-C that came since :meth:`__enter__`, if one did."""
        if self.hit:
            raise KeyboardInterrupt


def _local_task(job: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    from replayer.runs import run_one

    return job["index"], run_one(job, _LOCAL_TRACES[job.get("trace_key", "")], progress_q=_LOCAL_Q)


def run_local(jobs: Sequence[dict[str, Any]], traces: Mapping[str, Any], *, n_jobs: int,
              progress_q: Any = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """Run ``jobs`` in this process (``n_jobs`` 1) or in ``n_jobs`` forked workers, in the given order.

    ``progress_q``: a queue receiving ``(index, done, total, sim_time)``; with ``n_jobs`` > 1 it must
    be a :func:`multiprocessing.get_context("fork").Queue` (see :func:`local_progress_queue`).
    """
    global _LOCAL_TRACES, _LOCAL_Q
    _LOCAL_TRACES, _LOCAL_Q = traces, progress_q
    try:
        if n_jobs <= 1:
            with InterruptLatch() as ctrl_c:
                for j in jobs:
                    ctrl_c.check()
                    yield _local_task(j)
                ctrl_c.check()
            return
        pool = mp.get_context("fork").Pool(n_jobs)
        try:
            yield from pool.imap_unordered(_local_task, jobs)
            pool.close()
        finally:
            pool.terminate()  # Ctrl-C or a failed run: stop the other runs now (finished ones are saved)
            pool.join()
    finally:
        _LOCAL_TRACES, _LOCAL_Q = {}, None


def local_progress_queue(n_jobs: int) -> Any:
    """A progress queue that forked workers can write to (a plain queue when running inline)."""
    return mp.get_context("fork").Queue() if n_jobs > 1 else queue.Queue()


# ---------------------------------------------------------------------------------------- either

def execute(jobs: Sequence[dict[str, Any]], traces: Mapping[str, Any], *, ray: str | None, n_jobs: int,
            totals: Sequence[int], show: bool, force_progress: bool = False,
            tool: str = "replay") -> Iterator[tuple[int, dict[str, Any]]]:
    """Run ``jobs`` longest first, on Ray (``ray``: the ``--ray`` value, an address or "local") or the
    local pool (``n_jobs`` workers), with the progress line when ``show``; yield ``(index, result)``
    as runs finish, their files written. ``totals[index]``: the requests of run ``index``.
    Closing the generator (Ctrl-C) stops the runs in flight; finished runs stay saved."""
    from replayer.progress import note_done, progress_thread
    from replayer.runs import longest_first

    if not jobs:
        return
    ordered = [jobs[i] for i in longest_first([j["spec"] for j in jobs])]
    q = None
    stop = threading.Event()
    pthread = None
    if show:
        q = queue.Queue() if ray is not None else local_progress_queue(n_jobs)
        pthread = progress_thread(q, list(totals), stop, force=force_progress, label=tool)
    try:
        if ray is not None:
            it = run_ray(ordered, traces, address=ray_address(ray), progress_q=q,
                         on_start=lambda msg: print(f"gpuhit {tool}: {msg}", file=sys.stderr))
        else:
            it = run_local(ordered, traces, n_jobs=n_jobs, progress_q=q)
        for idx, r in it:
            note_done(r, show, tool)
            yield idx, r
    finally:
        stop.set()
        if q is not None:
            q.put((None, 0, 0, 0.0))
        if pthread is not None:
            pthread.join(timeout=2.0)


# ---------------------------------------------------------------------------------------- Ray

def ray_task(job: dict[str, Any], trace: Any, progress: Any) -> tuple[int, dict[str, Any], bytes]:
    """One run on a Ray worker: simulate into a private temp file, return (index, result, CSV bytes).

    ``trace`` arrives resolved from the object store; ``progress`` is the driver's progress actor
    (or None). The result's ``records`` path is the driver's to set.
    """
    from replayer.runs import run_one

    q = _ActorQueue(progress) if progress is not None else None
    with tempfile.TemporaryDirectory(prefix="gpuhit-run-") as tmp:
        rec = pathlib.Path(tmp) / "records.csv"
        result = run_one(dict(job, records=str(rec), result=None), trace, progress_q=q)
        data = rec.read_bytes()
    return job["index"], result, data


class _ActorQueue:
    """The ``put`` of a queue, forwarding to the driver's progress actor without waiting."""

    def __init__(self, actor: Any):
        self.actor = actor

    def put(self, item: Any) -> None:
        self.actor.put.remote(item)  # fire and forget: a lost progress tick only delays the display


class _ProgressBuffer:
    """Ray actor body: buffers progress ticks until the driver drains them."""

    def __init__(self) -> None:
        self.items: list[Any] = []

    def put(self, item: Any) -> None:
        self.items.append(item)

    def drain(self) -> list[Any]:
        out, self.items = self.items, []
        return out


def code_runtime_env() -> dict[str, Any]:
    """A Ray ``runtime_env`` that ships this checkout's gpuhit packages to the cluster's workers.

    Why: a run's records are only comparable (and byte-identical to a local run's) when every worker
    runs the driver's code, not whatever gpuhit version a node has installed. The packages'
    third-party dependencies (numpy, pandas, aiohttp, ...) must be installed on the nodes.
    """
    import analysis
    import engines
    import gateway
    import gpuhit
    import policies
    import replayer

    return {"py_modules": [str(pathlib.Path(m.__file__).parent) for m in
                           (gpuhit, replayer, gateway, policies, engines, analysis)]}


def run_ray(jobs: Sequence[dict[str, Any]], traces: Mapping[str, Any], *, address: str | None = None,
            progress_q: Any = None, num_cpus: int | None = None, max_retries: int = DEFAULT_MAX_RETRIES,
            ship_code: bool | None = None, task: Task | None = None,
            on_start: Callable[[str], None] | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """Run ``jobs`` as Ray tasks; yield ``(index, result)`` as each finishes, its files written.

    ``address``: an existing cluster (``ray://host:10001``, ``host:6379`` or ``auto``); None starts a
    local Ray for this call (``num_cpus`` CPUs, default all) and stops it afterwards. If this
    process is already connected to Ray, that connection is used and left open.
    ``ship_code``: send this checkout's packages with the tasks (default: when ``address`` is given).
    ``task``: the function each Ray task runs (default :func:`ray_task`; tests swap in one that
    kills its worker to exercise retries). Each task asks for one CPU; one run is single-threaded.
    """
    from replayer.runs import save_run

    ray = require_ray()
    started = False
    if not ray.is_initialized():
        # Ray's INFO lines (connecting, packaging) would bury the replay's own output; warnings stay.
        kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True, "logging_level": logging.WARNING}
        if ship_code or (ship_code is None and address is not None):
            kw["runtime_env"] = code_runtime_env()
        if address is None:
            kw["num_cpus"] = num_cpus
        try:
            ray.init(address=address, **kw)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            hint = ("; a cluster with token authentication (recent Ray's default) also needs RAY_AUTH_MODE=token "
                    "and its token in RAY_AUTH_TOKEN or ~/.ray/auth_token" if address is not None else "")
            raise GpuhitError(f"cannot connect to Ray at {address or 'a new local instance'}: {exc}{hint}") from None
        started = True
    if on_start is not None:
        res = ray.cluster_resources()
        on_start(f"Ray {'cluster ' + address if address else 'local instance'}: "
                 f"{res.get('CPU', 0):g} CPUs on {len(ray.nodes())} node(s)")
    remote = ray.remote(num_cpus=1, max_retries=max_retries, retry_exceptions=False)(task or ray_task)
    actor = ray.remote(num_cpus=0)(_ProgressBuffer).remote() if progress_q is not None else None
    refs: dict[Any, dict[str, Any]] = {}
    written: set[int] = set()
    try:
        trace_refs = {k: ray.put(t) for k, t in traces.items()}  # once per trace, shared by every task
        for j in jobs:
            refs[remote.remote(j, trace_refs[j.get("trace_key", "")], actor)] = j
        while refs:
            ready, _ = ray.wait(list(refs), num_returns=1, timeout=_PROGRESS_POLL_S)
            if actor is not None:
                for item in ray.get(actor.drain.remote()):
                    progress_q.put(item)
            for ref in ready:
                job = refs.pop(ref)
                try:
                    idx, result, data = ray.get(ref)
                except ray.exceptions.RayTaskError as exc:
                    cause = getattr(exc, "cause", None)
                    if isinstance(cause, GpuhitError):
                        raise cause from None
                    raise GpuhitError(f"run {job['spec'].label} seed {job['spec'].seed} failed on Ray: "
                                      f"{exc}") from None
                except ray.exceptions.RayError as exc:  # worker died more than max_retries times, ...
                    raise GpuhitError(f"run {job['spec'].label} seed {job['spec'].seed} was lost on Ray "
                                      f"after {max_retries} retries: {exc}") from None
                if idx in written:  # a duplicate delivery of a finished run: never counted twice
                    continue
                written.add(idx)
                _write_atomic(pathlib.Path(job["records"]), data)
                result["summary"]["records"] = job["records"]
                if job.get("result"):
                    save_run(pathlib.Path(job["result"]), result)
                yield idx, result
    finally:
        for ref in refs:  # Ctrl-C or a failed run: stop the others (finished runs are saved)
            ray.cancel(ref, force=True)
        if started:
            ray.shutdown()


def _write_atomic(path: pathlib.Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def ray_address(value: str | None) -> str | None:
    """``--ray`` given without an address means a local Ray started for the run."""
    return None if value in (None, "", "local") else value


__all__ = ["DEFAULT_MAX_RETRIES", "code_runtime_env", "execute", "local_progress_queue", "ray_address", "ray_task", "require_ray",
           "run_local", "run_ray"]

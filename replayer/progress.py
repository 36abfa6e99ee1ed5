"""A one-line progress display on stderr: runs and requests done/total, replay clock, sim/wall, ETA.

Redrawn at most ``max_hz`` times per second (the check is one wall-clock read per update, so it is
cheap enough to call per request). On a terminal it is one line rewritten in place (``\\r``); when
stderr is not a TTY (a log, a pipe, a test) there is no redrawn line unless ``force=True``, and a
many-run replay prints one plain line per finished run instead (:func:`note_done`). No dependency
beyond the standard library.

This is the one place in the replayer that reads the wall clock on purpose: the display is about
real elapsed time, and nothing it computes feeds back into the simulation.
"""

from __future__ import annotations

import math
import queue
import sys
import threading
import time
from typing import Any, TextIO


def _fmt_secs(s: float) -> str:
    if math.isnan(s) or math.isinf(s):  # unknown
        return "?"
    s = round(s)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


class Progress:
    """``update(done, sim_time)`` per finished request; ``close()`` at the end."""

    def __init__(self, total: int, *, label: str = "", enabled: bool | None = None, force: bool = False,
                 stream: TextIO | None = None, max_hz: float = 4.0):
        self.total = max(int(total), 0)
        self.label = label
        self.stream = stream or sys.stderr
        if enabled is None:
            enabled = force or bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = enabled
        self._interval = 1.0 / max_hz if max_hz > 0 else 0.0
        self._wall0 = time.monotonic()
        self._last_draw = -1e18
        self._done = 0
        self._sim = 0.0
        self._width = 0
        self.runs_total = 0  # > 0: the line also counts finished runs (set by progress_thread)
        self.runs_done = 0

    def line(self, done: int, sim_time: float, wall: float) -> str:
        """The text of the progress line (pure: exposed for tests)."""
        pct = 100.0 * done / self.total if self.total else 100.0
        ratio = sim_time / wall if wall > 0 else float("inf")
        eta = wall * (self.total - done) / done if done else float("nan")
        ratio_s = f"{ratio:,.0f}x" if ratio != float("inf") else "-"
        head = f"{self.label}: " if self.label else ""
        if self.runs_total > 1:
            head += f"{self.runs_done}/{self.runs_total} runs, "
        return (f"{head}{done}/{self.total} requests ({pct:5.1f}%)  sim {_fmt_secs(sim_time)}  "
                f"wall {_fmt_secs(wall)}  sim/wall {ratio_s}  ETA {_fmt_secs(eta)}")

    def update(self, done: int, sim_time: float) -> None:
        self._done, self._sim = done, sim_time
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last_draw < self._interval and done < self.total:
            return
        self._last_draw = now
        self._draw(now)

    def _draw(self, now: float) -> None:
        text = self.line(self._done, self._sim, now - self._wall0)
        pad = max(self._width - len(text), 0)
        self._width = len(text)
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()


def progress_thread(q: Any, totals: list[int], stop: threading.Event, force: bool,
                    label: str = "replay") -> threading.Thread:
    """A thread drawing one :class:`Progress` line for many runs: it reads ``(index, done, total,
    sim_time)`` from ``q`` (runs report from worker processes or Ray through it), until ``stop`` is
    set or an ``(None, ...)`` item arrives. ``totals[index]``: run ``index``'s request count."""
    bar = Progress(sum(totals), label=label, force=force)
    bar.runs_total = len(totals)
    done = [0] * len(totals)
    sims = [0.0] * len(totals)

    def loop() -> None:
        while True:
            try:
                idx, d, _, sim = q.get(timeout=0.2)
            except queue.Empty:
                if stop.is_set():
                    break
                continue
            if idx is None:
                break
            done[idx], sims[idx] = d, sim
            bar.runs_done = sum(d_ >= t for d_, t in zip(done, totals) if t)
            bar.update(sum(done), sum(sims))
        bar.close()

    t = threading.Thread(target=loop, name=f"gpuhit-{label}-progress", daemon=True)
    t.start()
    return t


def note_done(r: dict[str, Any] | None, show: bool, tool: str = "replay") -> None:
    """One plain line on stderr for a finished run, when progress is shown and stderr is not a
    terminal (on a terminal the progress line counts the runs in place)."""
    if r is None or not show or sys.stderr.isatty():
        return
    s = r["summary"]
    print(f"gpuhit {tool}: {s['label']} seed {s['seed']}: {s['n_sent']} requests, {s['n_ok']} ok, "
          f"{s['n_rejected']} rejected, {s['n_failed']} failed, "
          f"{s['wall_s']:.1f} s wall, sim/wall {s['sim_wall_ratio']:,.0f}x", file=sys.stderr)

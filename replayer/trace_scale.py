"""Scale a trace down to a small model's context, keeping its reuse structure and think times.

Agentic prompts run to 100k+ tokens; the dummy-weight engines an experiment can afford on a CPU (or
a small GPU model) take a few thousand. Each session is divided by one integer factor ``f``: every
``f``-th hash id is kept and lengths are divided by ``f``, so a turn that extended its predecessor
still extends it (its hash ids are still a prefix-extension) and two sessions that shared blocks still
share them. Think times and arrivals are kept: the closed loop's gaps decide how long KV sits idle and
is evicted, which is what routing under a limited KV cache is about.
"""

from __future__ import annotations

import dataclasses
import math

from gpuhit.errors import ConfigError
from replayer.trace import Trace


def scale_to_context(trace: Trace, max_prompt: int, *, max_output: int | None = None,
                     max_turns: int | None = None) -> Trace:
    """``trace`` with every session's prompts scaled so that none exceeds ``max_prompt`` tokens.

    ``max_output`` caps each turn's output after scaling (decode time is not what routing changes;
    a short output keeps an experiment's cost in prefill); ``max_turns`` keeps each session's first
    turns only. A turn keeps at least one input and one output token.
    """
    if max_prompt < 1:
        raise ConfigError(f"max_prompt must be positive, got {max_prompt}")
    if max_output is not None and max_output < 1:
        raise ConfigError(f"max_output must be positive, got {max_output}")
    sessions = []
    for s in trace.sessions:
        turns = s.turns[:max_turns] if max_turns else s.turns
        if not turns:
            continue
        f = max(1, math.ceil(max(t.input_length for t in turns) / max_prompt))
        scaled = []
        for t in turns:
            ids = t.hash_ids[::f]
            n = min(max(t.input_length // f, 1), max(len(ids), 1) * s.block_size)
            out = max(t.output_length // f, 1)
            if max_output is not None:
                out = min(out, max_output)
            scaled.append(dataclasses.replace(t, input_length=n, output_length=out, hash_ids=ids))
        sessions.append(dataclasses.replace(s, turns=tuple(scaled), system_tokens=s.system_tokens // f))
    return dataclasses.replace(trace, sessions=tuple(sessions))

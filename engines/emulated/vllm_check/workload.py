"""Request streams for the differential check (JSON-ready dicts, read by both sides).

A workload is ``{"name", "config", "requests", "max_steps"}``. ``config``: ``block_size``,
``num_gpu_blocks`` (null block included), ``max_num_batched_tokens``, ``max_num_seqs``,
``max_model_len``, ``chunked_prefill``, ``policy`` (fcfs|priority), ``prefix_caching``. A request:
``id``, ``prompt`` and ``output`` (token ids; ``len(output)`` is max_tokens, and the model
"samples" exactly these), ``arrival`` (the step before which it arrives), ``arrival_time``
(vLLM's tie-break in priority order), ``abort`` (step or null), ``priority``.

Streams are sized so the pool fills: prompts share prefixes (so hits and evictions happen),
many requests arrive within a few steps (so the head of the queue waits for blocks and running
requests are preempted), prompts exceed the token budget (chunked prefill), some are aborted.

The priority configurations also come in two shapes aimed at what only vLLM's priority scheduler
does. ``ties``: requests of one step share one ``arrival_time`` and carry ids out of arrival order,
as requests arriving at one instant of virtual time do, so the waiting heap's last tie-break (the
request id) and the victim among equal running requests (``max()`` keeps the first of equals in
``running``) decide. ``pressure``: a pool a few prompts wide, many requests, and priorities that
improve with arrival (a late request outranks the running ones), prompts of a third of the pool or
more and a small token budget, so running requests often cannot grow and the lowest-priority
running one, not the last admitted, is preempted.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any

#: generation shapes (see the module docstring); "mixed" is the default
SHAPES = ("mixed", "ties", "pressure")


def _cfg(block_size: int, budget: int, max_seqs: int, chunked: bool, policy: str, prefix: bool,
         shape: str = "mixed") -> dict[str, Any]:
    cfg = {"block_size": block_size, "max_num_batched_tokens": budget, "max_num_seqs": max_seqs,
           "chunked_prefill": chunked, "policy": policy, "prefix_caching": prefix}
    if shape != "mixed":
        cfg["shape"] = shape
    return cfg


#: the checked vLLM configurations (name -> config); num_gpu_blocks is set per stream
CONFIGS: dict[str, dict[str, Any]] = {
    "bs16-small": _cfg(16, 64, 4, True, "fcfs", True),
    "bs16-default": _cfg(16, 8192, 256, True, "fcfs", True),
    "bs128-small": _cfg(128, 256, 6, True, "fcfs", True),
    "bs16-nochunk": _cfg(16, 512, 8, False, "fcfs", True),
    "bs16-priority": _cfg(16, 96, 5, True, "priority", True),
    "bs128-priority-default": _cfg(128, 8192, 256, True, "priority", True),
    "bs16-noprefix": _cfg(16, 64, 4, True, "fcfs", False),
    "bs16-priority-ties": _cfg(16, 96, 5, True, "priority", True, "ties"),
    "bs16-priority-pressure": _cfg(16, 24, 4, True, "priority", True, "pressure"),
}


def _config(name: str, num_gpu_blocks: int) -> dict[str, Any]:
    cfg = dict(CONFIGS[name])
    cfg["num_gpu_blocks"] = num_gpu_blocks
    # without chunked prefill vLLM requires the budget to hold any prompt (its own config check)
    cfg["max_model_len"] = cfg["max_num_batched_tokens"] if not cfg["chunked_prefill"] else 1 << 16
    return cfg


def generated(config: str, seed: int) -> dict[str, Any]:
    """One random stream for ``config`` (deterministic in ``seed``)."""
    rng = random.Random(f"{config}/{seed}")
    base = CONFIGS[config]
    shape = base.get("shape", "mixed")
    bs = base["block_size"]
    if shape == "pressure":
        num_blocks = rng.randint(10, 20)
    else:
        num_blocks = rng.randint(8, 24) if bs == 128 else rng.randint(12, 48)
    usable = num_blocks - 1
    max_len = usable * bs
    if not base["chunked_prefill"]:
        max_len = min(max_len, base["max_num_batched_tokens"])
    # shared documents: prompts start with one of them (a prefix of it), then a private tail
    docs = [[rng.randrange(3, 30000) for _ in range(rng.randint(bs, 4 * bs))] for _ in range(rng.randint(1, 4))]
    n_req = rng.randint(10, 24) if shape == "pressure" else rng.randint(3, 12)
    # "ties": ids drawn out of arrival order (the heap's last tie-break must not follow arrival)
    ids = rng.sample(range(1000), n_req) if shape == "ties" else list(range(n_req))
    reqs = []
    step = 0
    for i in range(n_req):
        step += rng.choice((0, 0, 0, 1, 1, 2, 5))
        out_len = rng.randint(1, 3 * bs if bs == 16 else 40)
        total_max = rng.randint(max(2, max_len // 3), max_len) if shape == "pressure" else rng.randint(2, max_len)
        out_len = min(out_len, total_max - 1)
        prompt_len = rng.randint(1, total_max - out_len)
        prompt: list[int] = []
        if rng.random() < 0.8:
            d = rng.choice(docs)
            prompt = d[: rng.randint(1, len(d))][:prompt_len]
        prompt += [rng.randrange(3, 30000) for _ in range(prompt_len - len(prompt))]
        r = {
            "id": f"r{ids[i]:03d}", "prompt": prompt, "output": [rng.randrange(3, 30000) for _ in range(out_len)],
            "arrival": step, "arrival_time": step + i * 1e-3, "priority": rng.randint(0, 3),
            "abort": step + rng.randint(0, 30) if rng.random() < 0.12 else None,
        }
        if shape == "ties":
            r["arrival_time"] = float(step)
            r["priority"] = rng.randint(0, 1)
        elif shape == "pressure":
            # later arrivals mostly outrank earlier ones: the running set is the low-priority part
            r["priority"] = max(0, n_req - i + rng.randint(-3, 3)) // 4
        reqs.append(r)
    return {"name": f"{config}/gen{seed}", "config": _config(config, num_blocks), "requests": reqs,
            "max_steps": 20000}


def from_sessions(config: str, name: str, sessions: Sequence[Sequence[tuple[Sequence[int], int]]],
                  num_gpu_blocks: int, gap: int = 2) -> dict[str, Any]:
    """A stream from real sessions: each turn is ``(prompt token ids, output length)``; a session's
    turns arrive ``gap`` steps apart, sessions interleaved (turn k of every session, then k + 1).
    Output tokens are the next turn's tokens where it continues the conversation (so the next turn
    hits the blocks this one decoded), else fresh ids."""
    reqs = []
    rng = random.Random(name)
    n_turns = max(len(s) for s in sessions)
    i = 0
    for k in range(n_turns):
        for si, sess in enumerate(sessions):
            if k >= len(sess):
                continue
            prompt, out_len = sess[k]
            nxt = sess[k + 1][0] if k + 1 < len(sess) else None
            if nxt is not None and len(nxt) >= len(prompt) + out_len and list(nxt[: len(prompt)]) == list(prompt):
                output = list(nxt[len(prompt): len(prompt) + out_len])
            else:
                output = [rng.randrange(3, 30000) for _ in range(out_len)]
            step = k * gap + si % gap
            reqs.append({"id": f"s{si:02d}t{k:02d}", "prompt": list(prompt), "output": output, "arrival": step,
                         "arrival_time": step + i * 1e-3, "priority": (si + k) % 3, "abort": None})
            i += 1
    reqs.sort(key=lambda r: r["arrival_time"])
    return {"name": f"{config}/{name}", "config": _config(config, num_gpu_blocks), "requests": reqs,
            "max_steps": 200000}


def generated_streams(config: str, n: int, first_seed: int = 0) -> Iterator[dict[str, Any]]:
    for s in range(first_seed, first_seed + n):
        yield generated(config, s)

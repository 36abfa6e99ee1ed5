"""The emulator checked step by step against vLLM's own scheduler (``gpuhit emulate-check``).

* :mod:`.workload` makes request streams (JSON): configs, prompts, the tokens each request will
  "sample", arrival and abort steps, priorities;
* :mod:`.vllm_side` runs them through vLLM's real ``Scheduler`` + ``KVCacheManager`` in the vLLM
  venv (a subprocess; imports only vllm), :mod:`.emu_side` through the emulated engine;
* :mod:`.compare` lines the per-step records up and reports the first mismatch with context.

A step is one ``schedule()`` followed by the model's output; before it, the step's aborts then
its arrivals are handed to the scheduler. Records compare the scheduled requests and token
counts, preemptions in order, finished requests, every live request's ``num_computed_tokens``
and block ids, the free queue (LRU order), the KV events, each admission's prefix-cache lookup
and the cumulative prefix-cache counters. Step time is the only thing not compared.
"""

"""Engines: the EngineClient contract, vLLM's block hashing and KV events, the emulated engine
(``engines.emulated``), the real-vLLM adapter (``engines.vllm``), KV transfer and attention."""

# Some of this package's modules may be compiled (``make compile``, :mod:`gpuhit.native`): a stale or
# partial build is refused here, before any of them is imported.
from gpuhit import native as _native

_native.check_once()

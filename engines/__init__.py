"""Engines: the EngineClient contract, vLLM's block hashing and KV events, the emulated engine
(``engines.emulated``), the real-vLLM adapter (``engines.vllm``), KV transfer and attention."""

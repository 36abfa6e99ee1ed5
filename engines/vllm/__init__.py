"""The real-vLLM adapter: HTTP completions (:mod:`.client`), ``/metrics`` scraping
(:mod:`.metrics_scrape`), KV events over ZMQ (:mod:`.kv_events_zmq`), health checks (:mod:`.health`)
and the OpenAI/vLLM wire shapes shared with the gateway and the emulated server (:mod:`.protocol`)."""

"""The real-vLLM adapter: HTTP completions (:mod:`.client`), ``/metrics`` scraping
(:mod:`.metrics_scrape`), KV events over ZMQ (:mod:`.kv_events_zmq`; the publishing end, for the
emulated server, :mod:`.kv_events_publisher`), health checks (:mod:`.health`) and the OpenAI/vLLM wire
shapes shared with the gateway and the emulated server (:mod:`.protocol`)."""

"""The HTTP face of the gateway (``gpuhit serve``): :mod:`.app` (the gateway: start, stop, wiring),
:mod:`.pipeline` (parse -> route -> forward -> settle), the transports (:mod:`.fast`, :mod:`.aio`)
and :mod:`.prompt` (prompt -> token ids and block hashes for routing)."""

"""The HTTP face of the gateway (``gpuhit serve``): :mod:`.app` (handlers, proxying, streaming) and
:mod:`.prompt` (prompt -> block hashes for routing)."""

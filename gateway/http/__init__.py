"""The HTTP face of the gateway (``gpuhit serve``): :mod:`.app` (handlers, proxying, streaming) and
:mod:`.prompt` (prompt -> block hashes for routing).

The fast transport's modules may be compiled (``make compile``, :mod:`gpuhit.native`); the
``gateway`` package refuses a stale or partial build before any of them is imported."""

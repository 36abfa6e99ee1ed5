"""The HTTP face of the gateway (``gpuhit serve``): :mod:`.app` (handlers, proxying, streaming) and
:mod:`.prompt` (prompt -> block hashes for routing).

The fast transport's modules may be compiled (``make compile``, :mod:`gpuhit.native`): a stale or
partial build is refused here, before any of them is imported."""

from gpuhit import native as _native

_native.check()

"""Gateway: the routing core (snapshot -> policy -> action, KV index, bindings) and the HTTP server."""

# Some of this package's modules may be compiled (``make compile``, :mod:`gpuhit.native`): a stale or
# partial build is refused here, before any of them is imported.
from gpuhit import native as _native

_native.check_once()

"""Gateway: the routing core (snapshot -> policy -> action, KV index, bindings) and the HTTP server."""

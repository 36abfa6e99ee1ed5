"""The parts of one client request as httptools' parser hands them over (the ``fast`` transport,
:mod:`gateway.http.fast`): its target, its header fields and its body, each bounded as it arrives.

Why a stage of its own: the parser calls back once per header field, and a chat request from a
common client carries six or more; as a Python method each callback costs a frame and ~50
bytecodes, about a tenth of the gateway's instructions for a short request. The collector is
given to the parser as the connection's ``on_message_begin`` / ``on_url`` / ``on_header`` /
``on_body``: :class:`RequestParts` here is the reference, and the C speedups' ``RequestParts``
(``gpuhit/_reqparts.c``) the one fast path, with the same fields and answers
(``tests/gateway/test_request_parts.py`` holds the two to each other).

A part over its limit sets :attr:`RequestParts.error` (``"url"``, ``"headers"`` or ``"body"``) and
raises ``ValueError``, which the parser turns into its callback error: the connection reads
``error`` and refuses the request with the matching answer (414, 431, 413).
"""

from __future__ import annotations


class RequestParts:
    """One connection's request in progress: ``url`` (the request target's bytes), ``headers``
    (lower-case names, latin-1 values; a repeated field's values joined with ``", "``), ``body``
    (its chunks), ``partial`` (a request has begun and is not complete: the connection clears it
    when the parser completes the message). Limits: ``max_line`` bytes of target, ``max_header_bytes``
    of names and values together and ``max_headers`` fields, ``max_body`` bytes of body."""

    __slots__ = ("body", "error", "header_bytes", "headers", "max_body", "max_header_bytes", "max_headers",
                 "max_line", "partial", "size", "url")

    def __init__(self, max_line: int, max_header_bytes: int, max_headers: int, max_body: int):
        self.max_line = max_line
        self.max_header_bytes = max_header_bytes
        self.max_headers = max_headers
        self.max_body = max_body
        self.url = b""
        self.headers: dict[str, str] = {}
        self.header_bytes = 0
        self.body: list[bytes] = []
        self.size = 0
        self.partial = False
        self.error: str | None = None

    def on_message_begin(self) -> None:
        self.url = b""
        self.headers = {}  # a new dict: the previous request keeps its own
        self.header_bytes = 0
        self.body = []
        self.size = 0
        self.partial = True
        self.error = None

    def on_url(self, url: bytes) -> None:
        url = self.url = self.url + url  # once a request, but for a target split across reads
        if len(url) > self.max_line:
            self.error = "url"
            raise ValueError("request target over the limit")

    def on_header(self, name: bytes, value: bytes) -> None:
        size = self.header_bytes = self.header_bytes + len(name) + len(value)
        h = self.headers
        if size > self.max_header_bytes or len(h) >= self.max_headers:
            self.error = "headers"
            raise ValueError("request header fields over the limit")
        key = name.decode("latin-1").lower()
        if key in h:  # a repeated field: its values joined, as one field
            h[key] = f"{h[key]}, {value.decode('latin-1')}"
        else:
            h[key] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size > self.max_body:
            self.error = "body"
            raise ValueError("request body over the limit")
        self.body.append(body)

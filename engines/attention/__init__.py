"""Route the query, not the cache: cross-instance partial attention and its exact merge.

A query row's attention over a KV set split across several holders equals the online-softmax merge
of per-holder partials ``(o, m, l)`` (*Move the Query, Not the Cache*, FlashAttention's tile algebra carried between
instances). This package holds the primitive (:mod:`.partial`, :mod:`.merge`), the model shapes
(:mod:`.shapes`) and the transports that ship query rows to a holder and partials back
(:mod:`.transports`). The route/fetch/local *decision* lives in :mod:`policies.costmodel`.

The NVSHMEM transport (:mod:`.nvshmem_transport`) puts requests and partials into symmetric per-peer
slots with nvshmem4py's ``put_signal`` and polls the signal words from the host; every library call
sits in one adapter, and :mod:`.fake_nvshmem` runs the same protocol with several PEs in one process
(a test double, not a transport) so it is tested without GPUs.

torch is imported lazily: importing this package never needs it; calling the primitive without
torch raises :class:`gpuhit.errors.UnavailableError`.
"""

from __future__ import annotations

from engines.attention.shapes import GQA_LLAMA8B, MLA_DSV2_LITE, MLA_FRONTIER, AttentionShape

__all__ = ["GQA_LLAMA8B", "MLA_DSV2_LITE", "MLA_FRONTIER", "AttentionShape"]

"""gpuhit: GPU-hit-first routing gateway, closed-loop trace replayer and emulated vLLM engine.

This thin package holds only what every other package shares: the error hierarchy
(:mod:`gpuhit.errors`), the virtual-time event loop (:mod:`gpuhit.vtime`) and the ``gpuhit``
command line (:mod:`gpuhit.cli`). The product lives in ``gateway``, ``replayer``, ``policies``,
``engines`` and ``analysis``.
"""

__version__ = "0.1.0"

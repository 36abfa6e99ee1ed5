"""gpuhit: GPU-hit-first routing gateway, closed-loop trace replayer and emulated vLLM engine.

This thin package is the ground: it holds only what every other package shares (the error hierarchy
:mod:`gpuhit.errors`, the virtual-time event loop :mod:`gpuhit.vtime`, tracing) and imports nothing
above it. The product lives in ``engines``, ``policies``, ``gateway``, ``analysis`` and ``replayer``
(the ``gpuhit`` command line is :mod:`replayer.cli`, at the top).
"""

__version__ = "0.1.0"

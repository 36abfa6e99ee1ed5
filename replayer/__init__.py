"""Replayer: the trace model and loaders, exact token synthesis, and the closed-loop driver."""

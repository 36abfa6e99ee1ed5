"""The trace model: immutable sessions of turns, whatever format they were loaded from.

A *turn* is one request: its input and output lengths, the hash ids of its input blocks at the
trace's ``block_size`` (the last block may be partial), and the think time the user/agent spent
before sending it. A *session* is an ordered list of turns that share context (a conversation, or
a sub-agent, which is a child session with ``parent`` set). Hash ids are scoped by ``namespace``:
the conversation for locally scoped ids (WEKA), the whole trace for global ids (Mooncake, Bailian).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Turn:
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    # Seconds between the previous turn's completion and this turn's send (0 for the first turn).
    think_time: float = 0.0
    # Seconds from the session's start to this turn's recorded send time (open-loop replay).
    offset: float = 0.0
    model: str = ""


@dataclass(frozen=True, slots=True)
class Session:
    session_id: str
    turns: tuple[Turn, ...]
    block_size: int
    namespace: str
    # Seconds from the trace start at which the session's first turn was recorded.
    arrival: float = 0.0
    # Parent session id for sub-agents; the child starts ``arrival - parent.arrival`` after the parent.
    parent: str | None = None
    model: str = ""
    # Tokens of the shared per-model system prompt that prefixes every turn (0 = none).
    system_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    format: str  # "weka" | "mooncake" | "bailian" | "azure" | "native"
    sessions: tuple[Session, ...]
    hash_scope: str = "local"  # "local" (per session namespace) | "global"
    source: tuple[str, ...] = field(default_factory=tuple)  # files it was read from

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

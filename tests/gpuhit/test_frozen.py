"""``@record``: the faster constructor keeps every behaviour of a frozen, slotted dataclass."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from gpuhit.frozen import record


@record
class Point:
    x: int
    y: int = 2
    tags: tuple = dataclasses.field(default_factory=lambda: ("a",))


@dataclasses.dataclass(frozen=True, slots=True)
class Reference:
    x: int
    y: int = 2
    tags: tuple = dataclasses.field(default_factory=lambda: ("a",))


def test_construction_defaults_and_keywords_match_the_dataclass():
    for args, kw in [((1,), {}), ((1, 5), {}), ((1,), {"tags": ()}), ((), {"x": 3, "y": 4, "tags": ("b",)})]:
        got, ref = Point(*args, **kw), Reference(*args, **kw)
        assert dataclasses.astuple(got) == dataclasses.astuple(ref)
    calls = []

    @record
    class Counted:
        v: int = dataclasses.field(default_factory=lambda: calls.append(1) or len(calls))

    assert (Counted().v, Counted().v, Counted(0).v) == (1, 2, 0)  # the factory runs per instance, only if needed
    with pytest.raises(TypeError):
        Point()  # a required field stays required
    with pytest.raises(TypeError):
        Point(1, 2, (), 4)
    assert str(inspect.signature(Point)) == str(inspect.signature(Reference))


def test_frozen_equal_hashable_replaceable():
    p = Point(1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.x = 2  # type: ignore[misc]
    assert p == Point(1, 2, ("a",)) and hash(p) == hash(Point(1))
    assert dataclasses.replace(p, y=9) == Point(1, 9)
    assert not hasattr(p, "__dict__")  # still slotted
    assert repr(p) == "Point(x=1, y=2, tags=('a',))"


def test_post_init_runs_and_kw_only_is_refused():
    seen = []

    @record
    class Checked:
        a: int

        def __post_init__(self) -> None:
            seen.append(self.a)

    Checked(7)
    assert seen == [7]
    with pytest.raises(TypeError, match="kw_only"):
        @record
        class KwOnly:
            a: int = dataclasses.field(kw_only=True)

"""vitlab.common.registry: the one mechanism behind the vision-model and LM registries, and its errors."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

import vitlab
from vitlab.common.registry import Registry, check_options, unknown_name_error
from vitlab.tasks.lm import LM_CONFIGS, list_lms


@dataclass
class Point:
    x: int = 0
    y: int = 0


def points() -> Registry[dict]:
    return Registry("point", lambda row: (Point, row), rows={"origin": {}, "unit_x": {"x": 1}, "unit_y": {"y": 1}})


def test_register_list_get_create():
    reg = points()
    assert reg.names() == ["origin", "unit_x", "unit_y"] and reg.names("unit_*") == ["unit_x", "unit_y"]
    assert list(reg.rows) == ["origin", "unit_x", "unit_y"]  # registration order
    assert reg.get("unit_x") == {"x": 1}
    assert reg.create("unit_x", y=2) == Point(1, 2)
    assert reg.arguments("unit_y", {"x": 3}) == (Point, {"y": 1, "x": 3})
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("origin", {})
    with pytest.raises(TypeError):
        reg.rows["new"] = {}  # the view is read-only


def test_unknown_names_and_options():
    reg = points()
    with pytest.raises(
        ValueError, match=r"unknown point 'origen'; did you mean one of the closest: origin\? \(known: origin, unit_x"
    ):
        reg.get("origen")
    with pytest.raises(ValueError, match="unit_x: unknown option"):
        reg.create("unit_x", z=1)
    assert "known: a, b" in str(unknown_name_error("thing", "zzz", ["a", "b"]))
    assert "closest" not in str(unknown_name_error("thing", "zzz", ["a", "b"]))
    assert "f() lists all 2" in str(unknown_name_error("thing", "zzz", ["a", "b"], listed_by="f()"))
    check_options("p", ["x"], Point)
    with pytest.raises(ValueError, match=r"p: unknown option\(s\) w, z; Point accepts: x, y"):
        check_options("p", ["z", "w", "x"], Point)


def test_vision_and_sequence_registries_are_separate_namespaces():
    assert not set(vitlab.list_models()) & set(list_lms())
    assert list(LM_CONFIGS) and set(LM_CONFIGS) == set(list_lms())
    with pytest.raises(ValueError, match="unknown model 'tiny_aft_simple'"):
        vitlab.create_model("tiny_aft_simple")

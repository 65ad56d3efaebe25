"""The name -> implementation registry every room uses."""

from __future__ import annotations

import pytest

from fp8rl_core.registry import Registry

pytestmark = pytest.mark.timeout(30)


def test_an_unknown_name_lists_the_valid_ones_and_a_name_registers_once() -> None:
    reg: Registry[int] = Registry("thing")
    reg.register("b")(2)
    reg.register("a")(1)
    assert reg.names() == ["a", "b"] and reg.get("a") == 1 and "b" in reg and "c" not in reg
    with pytest.raises(KeyError, match="unknown thing 'c'; valid: a, b"):
        reg.get("c")
    with pytest.raises(ValueError, match="thing 'a' is already registered"):
        reg.register("a")(3)


def test_a_registered_class_carries_its_name() -> None:
    reg: Registry[type] = Registry("engine")

    @reg.register_class("fast")
    class Fast:
        name = "unset"

    assert reg.get("fast") is Fast and Fast.name == "fast"
    with pytest.raises(ValueError, match="already registered"):
        reg.register_class("fast")(type("Other", (), {}))

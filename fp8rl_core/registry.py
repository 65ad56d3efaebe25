"""Name -> implementation registries (as verl's ``register_policy_loss``).

Choices such as the loss, the advantage estimator or the clip-bound policy are
looked up by name; an unknown name is an error listing the valid ones, never a
silent fallback.
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A small named registry. ``@reg.register("name")`` adds; ``reg.get(name)`` looks up."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = obj
            return obj

        return deco

    def register_class(self, name: str) -> Callable[[T], T]:
        """Class decorator that also sets the class's ``name`` attribute to its registered name."""
        register = self.register(name)

        def deco(cls: T) -> T:
            cls.name = name
            return register(cls)

        return deco

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            valid = ", ".join(sorted(self._items)) or "(none registered)"
            raise KeyError(f"unknown {self.kind} {name!r}; valid: {valid}") from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

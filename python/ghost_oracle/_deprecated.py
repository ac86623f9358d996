"""Old spellings of renamed public arguments and attributes, kept for one minor version.

A renamed keyword argument (`renamed_keywords`) or attribute (`RenamedAttribute`) still works
under its old name with a `DeprecationWarning` that names the new one, until the version
`REMOVED_IN`; passing both spellings of one argument is a `TypeError` naming both. The test of
every alias (python/tests/test_deprecated_names.py) fails once the package reaches
`REMOVED_IN`, so that the aliases go then.
"""
from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any, TypeVar, cast

#: The version whose release drops every alias here.
REMOVED_IN = "0.2"

F = TypeVar("F", bound=Callable[..., Any])


def _public(module: str) -> str:
    """The public module a name is documented under (`ghost_oracle._api` → `ghost_oracle`)."""
    parts = [p for p in module.split(".") if not p.startswith("_")]
    return ".".join(parts)


def renamed_keywords(**new_by_old: str) -> Callable[[F], F]:
    """A decorator: each keyword argument `old=` of the function is taken as `new_by_old[old]=`,
    with a `DeprecationWarning`; both spellings at once are a `TypeError`."""
    def decorate(fn: F) -> F:
        where = f"{_public(fn.__module__)}.{fn.__qualname__}"
        missing = sorted(set(new_by_old.values()) - set(inspect.signature(fn).parameters))
        if missing:  # a typo here would silently drop the argument
            raise TypeError(f"{where} has no argument {', '.join(missing)} to rename to")

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            for old, new in new_by_old.items():
                if old not in kwargs:
                    continue
                if new in kwargs:
                    raise TypeError(f"{where}() got both {new}= and its deprecated spelling {old}=: pass {new}= only")
                warn_renamed(f"{where}({old}=)", f"{new}=")
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return cast(F, call)

    return decorate


def warn_renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warns that `old` (a public name, spelled in full) is deprecated in favour of `new`: the
    one message every alias here gives."""
    warnings.warn(f"{old} is deprecated and goes in {REMOVED_IN}: use {new}", DeprecationWarning,
                  stacklevel=stacklevel)


_ABSENT = object()


class RenamedAttribute:
    """A class attribute `old = RenamedAttribute("new")`: reading (or setting) `obj.old` reads
    (sets) `obj.new`, with a `DeprecationWarning`. `new` may be a path (`"divisor.implied"`):
    where a step of it is None, reading gives `missing` (and setting is refused)."""

    def __init__(self, new: str, *, missing: Any = None) -> None:
        self.new = new
        self.missing = missing
        self.old = ""
        self.owner = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.old = name
        self.owner = f"{_public(owner.__module__)}.{owner.__qualname__}"

    def _warn(self) -> None:
        warn_renamed(f"{self.owner}.{self.old}", f"{self.owner}.{self.new}", stacklevel=4)

    def __get__(self, obj: object, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        self._warn()
        value: Any = obj
        for step in self.new.split("."):
            if value is None:
                return self.missing
            value = getattr(value, step)
        return value

    def __set__(self, obj: object, value: Any) -> None:
        self._warn()
        *path, last = self.new.split(".")
        target: Any = obj
        for step in path:
            target = getattr(target, step)
            if target is None:
                raise AttributeError(f"{self.owner}.{self.old} cannot be set: {self.owner}.{'.'.join(path)} is None")
        setattr(target, last, value)

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
                warnings.warn(f"{where}({old}=) is deprecated and goes in {REMOVED_IN}: use {new}=",
                              DeprecationWarning, stacklevel=2)
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return cast(F, call)

    return decorate


class RenamedAttribute:
    """A class attribute `old = RenamedAttribute("new")`: reading (or setting) `obj.old` reads
    (sets) `obj.new`, with a `DeprecationWarning`."""

    def __init__(self, new: str) -> None:
        self.new = new
        self.old = ""
        self.owner = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.old = name
        self.owner = f"{_public(owner.__module__)}.{owner.__qualname__}"

    def _warn(self) -> None:
        warnings.warn(f"{self.owner}.{self.old} is deprecated and goes in {REMOVED_IN}: use {self.owner}.{self.new}",
                      DeprecationWarning, stacklevel=3)

    def __get__(self, obj: object, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        self._warn()
        return getattr(obj, self.new)

    def __set__(self, obj: object, value: Any) -> None:
        self._warn()
        setattr(obj, self.new, value)

"""A small generic registry: names in YAML and on the CLI map to classes.

A new scheduler, latency model or workload format is one file plus one decorator::

    @SCHEDULERS.register("chunked_prefill")
    class ChunkedPrefill(Scheduler): ...

A registry given its package finds the package's entries by reading its modules' source for
that decorator, and imports a module only when its entry is asked for: the CLI lists names
without importing every policy (and numpy), and a new file needs no import list to be found.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")


def registered_names(package: str, attribute: str) -> dict[str, str]:
    """The names a package's modules register with `@<attribute>.register("name")`, each with
    its module, read from their source without importing them (nor the package)."""
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.submodule_search_locations, package
    pattern = re.compile(rf'^@{re.escape(attribute)}\.register\(\s*"([^"]+)"\s*\)', re.M)
    found: dict[str, str] = {}
    for location in spec.submodule_search_locations:
        for path in sorted(Path(location).glob("*.py")):
            for name in pattern.findall(path.read_text(encoding="utf-8")):
                found[name] = f"{package}.{path.stem}"
    return found


class Registry(Generic[T]):
    """Maps a name to a registered object (usually a class). With `package` and `attribute`
    (the registry's name in its modules), the package's entries are known before they are
    imported, and imported when asked for."""

    def __init__(self, kind: str, package: str | None = None,
                 attribute: str | None = None) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}
        self._source = (package, attribute) if package and attribute else None
        self._modules: dict[str, str] | None = None  # name -> module, read on first use

    def register(self, name: str) -> Callable[[T], T]:
        def add(obj: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = obj
            return obj

        return add

    def _unimported(self) -> dict[str, str]:
        if self._modules is None:
            self._modules = {} if self._source is None else registered_names(*self._source)
        return self._modules

    def get(self, name: str) -> T:
        """The entry for `name`; KeyError whose message lists the known names."""
        if name not in self._entries and name in self._unimported():
            importlib.import_module(self._unimported()[name])
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(self.names())
            raise KeyError(f"unknown {self.kind} {name!r}; known: {known}") from None

    def names(self) -> list[str]:
        return sorted({*self._entries, *self._unimported()})

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._unimported()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

"""The registries of code: the names a package's modules register are known from their source
before any is imported, each name imports its own module when asked for, and what the source
says is what the modules register."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

from sim.cli.listing import REGISTRIES
from sim.core.registry import Registry, registered_names
from tests.helpers import imported_by, probe


@pytest.mark.parametrize(("package", "attribute"), [(p, a) for _, p, a in REGISTRIES],
                         ids=[p for _, p, _ in REGISTRIES])
def test_the_source_names_what_the_modules_register(package, attribute):
    found = registered_names(package, attribute)
    registry = getattr(importlib.import_module(package), attribute)
    for module in pkgutil.iter_modules(importlib.import_module(package).__path__):
        importlib.import_module(f"{package}.{module.name}")
    built_in = {name: obj.__module__ for name, obj in registry._entries.items()
                if obj.__module__.startswith(package + ".")}
    assert found == built_in
    assert len(found) >= 5


def test_a_name_imports_its_module_only():
    code = "from sim.routers import ROUTERS\nrouter = ROUTERS.get('random')"
    assert probe(code, "router.__module__") == "sim.routers.random"
    assert imported_by(code, ("sim.routers.vllm_dp", "sim.routers.prefix_affinity")) == []
    names = probe("from sim.routers import ROUTERS", "ROUTERS.names()")
    assert "vllm_dp" in names and "prefix_affinity" in names
    assert imported_by("from sim.routers import ROUTERS\n'vllm_dp' in ROUTERS",
                       ("sim.routers.vllm_dp",)) == []


def test_an_unknown_name_lists_the_known_ones_and_a_registered_one_is_found():
    registry: Registry[type] = Registry("router", "sim.routers", "ROUTERS")
    with pytest.raises(KeyError, match="unknown router 'nope'; known: least_kv_load, "):
        registry.get("nope")

    @registry.register("mine")
    class Mine:
        pass

    assert registry.get("mine") is Mine and "mine" in registry.names()
    with pytest.raises(ValueError, match="registered twice"):
        registry.register("mine")(Mine)

"""What every section of a scenario shares: frozen, strict models (`sim.config.errors.INPUT_MODEL`),
a registry's entry picked by name with its own parameter class, and the fields a check names
when they were changed from their defaults."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from sim.config.errors import INPUT_MODEL, as_written, invalid
from sim.core.registry import Registry


class Frozen(BaseModel):
    """A section of a scenario: unknown keys refused by name, strict types, frozen."""

    model_config = INPUT_MODEL


def dispatch(registry: Registry[Any], key: str, value: Any) -> Any:
    """Validate a `{key: name, ...}` mapping with the parameter class the name registers."""
    if not isinstance(value, dict):
        return value
    known = ", ".join(registry.names())
    if key not in value:
        raise ValueError(f"needs '{key}', one of: {known}")
    name = value[key]
    if not isinstance(name, str) or name not in registry:
        raise invalid((key, name, f"unknown {registry.kind}; known: {known}"))
    return registry.get(name).Config.model_validate(value)


def changed_fields(model: BaseModel, *names: str) -> list[tuple[str, Any]]:
    """The named fields whose values differ from their defaults, each as a scenario writes it
    (a model as its mapping). (Whether a field was given cannot be told from a resolved
    scenario, which spells every default out.)"""
    fields = type(model).model_fields
    return [(name, _as_written(getattr(model, name))) for name in names
            if getattr(model, name) != fields[name].get_default(call_default_factory=True)]


def _as_written(value: Any) -> Any:
    """A field's value shown in an error: a model as the mapping a scenario gives it."""
    if isinstance(value, BaseModel):
        return as_written(value.model_dump(mode="json"))
    return value

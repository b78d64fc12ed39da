"""Changing a scenario mapping at dotted paths: the one rule behind `--set PATH=VALUE` on the
command line and behind a sweep's axes (`replica.scheduler.token_budget: [256, 512]`).

`set_path(data, "replica.scheduler.token_budget", 512)` sets that field, creating the mappings on
the way. Setting the registry key of a mapping (`name` of a scheduler or router, `kind` of a
latency model, `format` of a workload) to another entry starts that mapping afresh, with the new
entry's defaults, as a comparison's variant naming another scheduler does: the old entry's
parameters would be unknown to the new one (`prefill_first` has no `token_budget`).

Overrides are applied to the mapping before validation, so a bad one is reported by the
scenario's own checks, named `--set PATH` (`named_by_overrides`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sim.config.errors import COMMAND_LINE, InputError, Problem
from sim.config.yaml_input import MALFORMED, NO_ALIASES, YamlProblem, load_yaml

if TYPE_CHECKING:  # pydantic's models are imported only when a scenario is loaded
    from sim.config.scenario import Scenario

Override = tuple[str, Any]  # dotted path, value
REGISTRY_KEYS = ("name", "kind", "format")
# A field's dotted path: what `--set` and a sweep's axes name.
FIELD_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def set_path(data: dict[str, Any], dotted: str, value: Any,
             defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """A copy of `data` with the field at `dotted` (e.g. replica.scheduler.token_budget) set;
    a registry key set to another entry replaces its mapping by `{key: value}`. A mapping on
    the way that `data` leaves out is created; where it is a registry entry's, the entry it
    defaults to is named from `defaults` (the scenario resolved without this change), so
    `replica.scheduler.token_budget` set on a file with no scheduler keeps the default one."""
    head, _, rest = dotted.partition(".")
    out = dict(data)
    if not rest:  # the scenario's own `name` is no registry key: set as it is
        out[head] = value
        return out
    inner = out.get(head)
    below = defaults.get(head) if isinstance(defaults, dict) else None
    if not isinstance(inner, dict):
        inner = {k: below[k] for k in REGISTRY_KEYS if isinstance(below, dict) and k in below}
    out[head] = _set_inside(inner, rest, value, below)
    return out


def _set_inside(data: dict[str, Any], dotted: str, value: Any,
                defaults: dict[str, Any] | None) -> dict[str, Any]:
    if "." not in dotted and dotted in REGISTRY_KEYS and dotted in data and data[dotted] != value:
        return {dotted: value}
    return set_path(data, dotted, value, defaults)


def apply_overrides(data: dict[str, Any], overrides: Iterable[Override],
                    defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """`data` with each override set in turn (a later one wins where they meet)."""
    for dotted, value in overrides:
        _check_path(data, dotted, defaults)
        data = set_path(data, dotted, value, defaults)
    return data


def _check_path(data: Any, dotted: str, defaults: Any) -> None:
    """A field set inside a value given by name (`replica.gpu.peak_bf16_flops` where
    `replica.gpu` is `h100-sxm`) would replace the name by a mapping missing everything else:
    say so in one line instead of listing what the new mapping lacks."""
    parts = dotted.split(".")
    for k, head in enumerate(parts[:-1]):
        given = data.get(head) if isinstance(data, dict) else None
        default = defaults.get(head) if isinstance(defaults, dict) else None
        value = given if given is not None else default
        if isinstance(value, str):
            where = ".".join(parts[:k + 1])
            raise InputError(COMMAND_LINE, "--set", dotted, (
                f"{where} is {value!r}, a name, not a mapping with fields: set it as a "
                f"mapping first, e.g. --set '{where}={{base: {value}, "
                f"{parts[k + 1]}: ...}}' (for a GPU), or the whole {where}"))
        data, defaults = given, default


def resolved_defaults(data: Any, source: str | Path, base_dir: Path | None
                      ) -> dict[str, Any] | None:
    """The scenario mapping `data` with every default spelled out, for `set_path`; None where
    it does not validate as it is (an override may be what completes it)."""
    from sim.config.scenario import parse_scenario

    try:
        return parse_scenario(data, source, base_dir).model_dump(mode="json")
    except InputError:
        return None


def parse_override(text: str) -> Override:
    """`PATH=VALUE` -> (path, value); the value read as YAML (`512` an integer, `2.5` a float,
    `true` a boolean, `null` none, `prefill_first` text, `{name: sglang}` a mapping)."""
    def bad(problem: str) -> InputError:
        return InputError(COMMAND_LINE, "--set", text, problem)

    dotted, eq, raw = text.partition("=")
    dotted = dotted.strip()
    if not eq:
        raise bad("must be PATH=VALUE, e.g. replica.scheduler.token_budget=512")
    if not FIELD_PATH.fullmatch(dotted):
        raise bad("PATH must be field names joined by '.', e.g. workload.arrivals.qps")
    if not raw.strip():
        raise bad("give a value after '=' (null for none)")
    try:
        return dotted, load_yaml(raw, aliases=False)
    except YamlProblem as exc:
        _, _, problem = exc.args
        if problem.startswith(MALFORMED):
            raise bad(f"VALUE is not YAML: {problem.removeprefix(MALFORMED)}") from None
        raise bad(problem if problem == NO_ALIASES else f"VALUE: {problem}") from None


def parse_overrides(texts: Sequence[str] | None) -> list[Override]:
    """Every `--set` given, in order."""
    return [parse_override(text) for text in texts or ()]


def related(field: str, dotted: str) -> bool:
    """Whether a problem at `field` concerns the override at `dotted`: the same field, one
    inside it, or a mapping on its way (an unknown field is reported at the first unknown
    name)."""
    return field == dotted or field.startswith(dotted + ".") or dotted.startswith(field + ".")


def named_by_overrides(exc: InputError, overrides: Sequence[Override], source: str | Path,
                       rename: Callable[[str], str] = str) -> InputError:
    """`exc`'s problems reported against `source`: those an override caused as `--set PATH=VALUE`
    with the field at fault in the problem, the rest renamed by `rename`."""
    problems = []
    for field, value, problem in exc.problems:
        dotted, given = next(((d, v) for d, v in reversed(overrides) if related(field, d)),
                             (None, None))
        if dotted is None:
            problems.append((rename(field), value, problem))
            continue
        if problem == "Extra inputs are not permitted":
            problem = "no such field"
        # The field as the file names it (a comparison's variants.<variant>.<field>): which of
        # several scenarios the override did not fit.
        at = "" if rename(field) == dotted else f"{rename(field)}: "
        problems.append((f"--set {dotted}", given, at + problem))
    return InputError.many(source, problems)


def problems_alone(base: dict[str, Any], base_file: Path, base_dir: Path) -> list[Problem]:
    """The problems a sweep's or comparison's base scenario file (`base_file`, read as
    `base`) has by itself; none if it is a whole scenario as it stands."""
    from sim.config.scenario import parse_scenario

    try:
        parse_scenario(base, base_file, base_dir)
    except InputError as exc:
        return list(exc.problems)
    return []


def split_base_problems(exc: InputError, alone: list[Problem],
                        overrides: Sequence[Override] = ()
                        ) -> tuple[list[Problem], list[Problem]]:
    """`exc`'s problems (a sweep point's or a comparison variant's) split into those its base
    file has by itself (`problems_alone`: the same field, value and problem, and no override
    sets the field), to be named by the base file, and the rest."""
    own: list[Problem] = []
    rest: list[Problem] = []
    for problem in exc.problems:
        in_base = problem in alone and not any(related(problem[0], d) for d, _ in overrides)
        (own if in_base else rest).append(problem)
    return own, rest


def load_scenario(path: str | Path | None, overrides: Sequence[Override] = ()) -> Scenario:
    """`sim.config.scenario.load_scenario` with `overrides` set in the file's mapping before it is
    checked."""
    from sim.config.scenario import parse_scenario, scenario_source

    data, source, base_dir = scenario_source(path)
    if not overrides:
        return parse_scenario(data, source, base_dir)
    if not isinstance(data, dict):  # parse_scenario's own error, before any override
        return parse_scenario(data, source, base_dir)
    defaults = resolved_defaults(data, source, base_dir)
    try:
        return parse_scenario(apply_overrides(data, overrides, defaults), source, base_dir)
    except InputError as exc:
        raise named_by_overrides(exc, overrides, source) from None



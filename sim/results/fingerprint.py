"""What a run's answer depends on, as hashes: the cache key of a sweep point.

A key covers the resolved scenario with each input file (a trace, a lengths file, a fitted
latency profile) replaced by the sha256 of its content, plus the servesim version and a hash of
the `sim` package's source. So editing a trace or a profile, or upgrading or editing servesim,
re-runs; moving the checkout (absolute paths change, contents do not) re-uses the cache.
"""

from __future__ import annotations

import hashlib
import json
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from sim.config.file_hash import file_sha256, size_bytes

if TYPE_CHECKING:
    from sim.config.scenario import Scenario


def input_files(scenario: Scenario) -> dict[str, Path]:
    """Every file the scenario reads, by dotted field (e.g. `workload.path`,
    `cluster.decode.replica.latency.path`): the path-valued fields of its models."""
    found: dict[str, Path] = {}

    def walk(value: Any, field: str) -> None:
        if isinstance(value, Path):
            found[field] = value
        elif isinstance(value, BaseModel):
            for name in type(value).model_fields:
                walk(getattr(value, name), f"{field}.{name}" if field else name)
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                walk(item, f"{field}.{i}")
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{field}.{key}")

    walk(scenario, "")
    return found


@cache
def code_fingerprint() -> str:
    """`<servesim version>+<hash of the sim package's source files>`, computed once per
    process: results depend on the code, and an editable install changes without a version."""
    import sim

    try:
        version = metadata.version("servesim")
    except metadata.PackageNotFoundError:
        version = "unknown"
    root = Path(sim.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.suffix in {".py", ".yaml", ".json"} and "__pycache__" not in path.parts:
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return f"{version}+{digest.hexdigest()[:16]}"


VERSIONED = ("numpy", "pandas", "pyarrow", "pydantic", "simpy")


def versions(extra: tuple[str, ...] = ()) -> dict[str, str]:
    """Python's and the result-shaping packages' versions (recorded beside a run's results),
    then those of `extra` packages."""
    import platform

    out = {"python": platform.python_version()}
    for name in (*VERSIONED, *extra):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def run_record(scenario: Scenario, inputs: list[dict[str, Any]] | None = None
               ) -> dict[str, Any]:
    """What `inputs.json` holds: the code fingerprint, the versions, and each input file's
    record (`inputs`, as a sweep hashed them when it keyed the run; else hashed now)."""
    return {"servesim": code_fingerprint(), "versions": versions(),
            "inputs": inputs_record(scenario) if inputs is None else inputs}


def inputs_record(scenario: Scenario, given: dict[str, str] | None = None
                  ) -> list[dict[str, Any]]:
    """Each input file: its field, its path as the user gave it (`given`, by field; else the
    resolved path), its size and sha256. Written beside a sweep point's results."""
    given = given or {}
    record = []
    for field, path in input_files(scenario).items():
        sha = file_sha256(path, source=scenario.source, field=field)
        record.append({"field": field, "path": given.get(field, str(path)),
                       "size_bytes": size_bytes(path, scenario.source, field),
                       "sha256": sha})
    return record


def scenario_key(scenario: Scenario) -> str:
    """16 hex digits that change whenever the answer could: the scenario with input paths
    replaced by their content hashes (no absolute path in it), and the code fingerprint."""
    data = scenario.model_dump(mode="json")
    hashes = {}
    for field, path in input_files(scenario).items():
        hashes[field] = file_sha256(path, source=scenario.source, field=field)
        _replace(data, field, "sha256:" + hashes[field])
    text = json.dumps({"scenario": data, "inputs": hashes, "code": code_fingerprint()},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _replace(data: Any, dotted: str, value: Any) -> None:
    """Put `value` at `dotted` in a dumped scenario. Should a field be dumped under another
    name, its path stays: a moved checkout then re-runs, which is slow but never wrong (the
    content hashes are in the key either way)."""
    *parents, last = dotted.split(".")
    try:
        for part in parents:
            data = data[int(part)] if isinstance(data, list) else data[part]
        if isinstance(data, list):
            data[int(last)] = value
        elif last in data:
            data[last] = value
    except (KeyError, IndexError, TypeError, ValueError):
        pass

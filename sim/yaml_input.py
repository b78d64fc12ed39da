"""Reading YAML input files (scenarios, sweeps, comparisons): one document, bounded in size once
aliases are expanded, every problem a one-line error naming the file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from sim.errors import InputError

# A scenario has about a hundred YAML nodes, a sweep a few thousand. Counting them with aliases
# expanded stops an alias bomb ("billion laughs") before it is built in memory.
MAX_YAML_NODES = 100_000


def read_yaml(path: Path) -> Any:
    """A YAML file's single document; one-line errors for anything else."""
    if path.is_dir():
        raise InputError(path, "<file>", str(path), "is a directory, not a YAML file")
    if not path.exists():
        raise InputError(path, "<file>", str(path), "file not found")
    if not path.is_file():
        raise InputError(path, "<file>", str(path), "not a regular file")
    try:
        data = _load_bounded(path.read_text())
    except OSError as exc:
        raise InputError(path, "<file>", str(path), f"cannot read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise InputError(path, "<file>", str(path), "not UTF-8 text") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "?"
        problem = getattr(exc, "problem", None) or str(exc)
        raise InputError(path, "<yaml>", where, f"malformed YAML: {problem}") from None
    except _TooBig:
        raise InputError(path, "<yaml>", f"more than {MAX_YAML_NODES} nodes",
                         "too large once aliases are expanded (an alias bomb?)") from None
    except _DuplicateKey as exc:
        field, line = exc.args
        raise InputError(path, f"{field} (line {line})", field.rsplit(".", 1)[-1],
                         "given twice in one mapping (YAML would silently keep the "
                         "last)") from None
    if data is None:
        raise InputError(path, "<file>", str(path), "empty: holds no YAML document")
    return data


class _TooBig(Exception):
    """The document expands past MAX_YAML_NODES nodes."""


class _DuplicateKey(Exception):
    """A mapping gives one key twice: (key, line)."""


def _load_bounded(text: str) -> Any:
    """`yaml.safe_load`, refusing documents past MAX_YAML_NODES nodes with aliases expanded.
    The node graph shares aliased nodes, so it is small even when its expansion is not."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_size(node, MAX_YAML_NODES) > MAX_YAML_NODES:
            raise _TooBig
        _check_unique_keys(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _expanded_size(root: yaml.Node, limit: int) -> int:
    """Nodes in the document once every alias is expanded (limit + 1 once past `limit`, or if
    an alias contains itself). Each distinct node is sized once; no recursion."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        children = _children(node)
        if children_done:
            on_path.discard(key)
            sizes[key] = 1 + sum(sizes[id(child)] for child in children)
            if sizes[key] > limit:
                return limit + 1
        elif key in on_path:
            return limit + 1  # recursive alias: infinite once expanded
        elif key not in sizes:
            on_path.add(key)
            stack.append((node, True))
            stack.extend((child, False) for child in children if id(child) not in sizes)
    return sizes[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def read_mapping(path: Path, kind: str, allowed: set[str]) -> dict[str, Any]:
    """A YAML file that must be a mapping with only `allowed` top-level keys (sweeps,
    comparisons)."""
    data = read_yaml(path)
    if not isinstance(data, dict) or set(data) - allowed:
        extra = sorted(set(data) - allowed) if isinstance(data, dict) else data
        raise InputError(path, "<top level>", extra, f"a {kind} has {', '.join(sorted(allowed))}")
    return data


def _check_unique_keys(root: yaml.Node) -> None:
    """Every mapping gives each key once (`<<` merges aside); each distinct node is read once."""
    seen_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, str]] = [(root, "")]
    while stack:
        node, where = stack.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            keys: set[str] = set()
            for key, value in node.value:
                name = key.value if isinstance(key, yaml.ScalarNode) else "?"
                if name in keys and name != "<<":
                    raise _DuplicateKey(f"{where}{name}", key.start_mark.line + 1)
                keys.add(name)
                stack.append((value, f"{where}{name}."))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, f"{where}{i}.") for i, item in enumerate(node.value))

"""Reading YAML input files (scenarios, sweeps, comparisons) and `--set` values: one document,
bounded in size, depth and number size once aliases are expanded, every key text, every
problem a one-line error naming the file."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from sim.config.errors import InputError, verbatim
from sim.config.input_file import MAX_INT_DIGITS, FileProblem, read_bytes

# A scenario has about a hundred YAML nodes, a sweep a few thousand. Counting them with aliases
# expanded stops an alias bomb ("billion laughs") before it is built in memory.
MAX_YAML_NODES = 100_000
# A scenario nests about 8 deep (cluster.prefill.replica.latency.noise...), a sweep's values a
# few more. PyYAML composes recursively: far deeper input ends in a RecursionError.
MAX_YAML_DEPTH = 64
# A sweep of thousands of points is tens of kilobytes; a scenario, one or two.
MAX_YAML_BYTES = 10_000_000
NO_ALIASES = "YAML anchors and aliases are not taken here"
MALFORMED = "malformed YAML: "

_STR, _MERGE = "tag:yaml.org,2002:str", "tag:yaml.org,2002:merge"
_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
# "Numbers are strict": YAML 1.1 (PyYAML) also reads 0100 as octal 64, 0x10, 0b110010, 1_0 and
# 1:00:00 (base 60, 3600) as numbers, which a reader of the file would take for other numbers
# or for text. Integers must be plain decimal; a float must not hold `_` or `:`.
_PLAIN_INT = re.compile(r"[-+]?(0|[1-9][0-9]*)")
_CONSTRUCT = yaml.constructor.SafeConstructor()
_KINDS = {"tag:yaml.org,2002:int": "a number", "tag:yaml.org,2002:float": "a number",
          "tag:yaml.org,2002:bool": "a boolean", "tag:yaml.org,2002:null": "none",
          "tag:yaml.org,2002:timestamp": "a date"}


class YamlProblem(ValueError):
    """What is wrong with a YAML text, as the (field, value, problem) of an InputError."""


def read_yaml(path: Path) -> Any:
    """A YAML file's single document; one-line errors for anything else (a file that is not
    regular, missing or too large; not UTF-8; see `load_yaml`)."""
    try:
        text = read_bytes(path, MAX_YAML_BYTES).decode("utf-8")
    except FileProblem as exc:
        raise InputError(path, "<file>", str(path), str(exc)) from None
    except UnicodeDecodeError:
        raise InputError(path, "<file>", str(path), "not UTF-8 text") from None
    try:
        data = load_yaml(text)
    except YamlProblem as exc:
        raise InputError(path, *exc.args) from None
    if data is None:
        raise InputError(path, "<file>", str(path), "empty: holds no YAML document")
    return data


def load_yaml(text: str, *, aliases: bool = True) -> Any:
    """`yaml.safe_load`, strictly: one document, at most MAX_YAML_NODES nodes with aliases
    expanded and MAX_YAML_DEPTH deep, each mapping key text given once (`<<` merges aside), no
    integer of more than MAX_INT_DIGITS digits (Python refuses to read past 4,300 digits, and
    no count we take is that large), every number plain decimal (no octal `0100`, `0x10`,
    `1_000` or base-60 `1:00:00`); no alias at all unless `aliases`. Problems raise
    `YamlProblem`."""
    try:
        return _load_bounded(text, aliases)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "?"
        problem = " ".join((getattr(exc, "problem", None) or str(exc)).split())  # one line
        raise YamlProblem("<yaml>", where, f"{MALFORMED}{problem}") from None
    except RecursionError:
        raise YamlProblem("<yaml>", f"more than {MAX_YAML_DEPTH} levels",
                          "nested too deeply") from None


def _load_bounded(text: str, aliases: bool) -> Any:
    """The document, checked as a node graph before it is built: the graph shares aliased
    nodes, so it is small even when its expansion is not."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if not aliases and _has_alias(node):
            raise YamlProblem("<yaml>", "*", NO_ALIASES)
        size, depth = _expanded_size(node, MAX_YAML_NODES)
        if size > MAX_YAML_NODES:
            raise YamlProblem("<yaml>", f"more than {MAX_YAML_NODES} nodes",
                              "too large once aliases are expanded (an alias bomb?)")
        if depth > MAX_YAML_DEPTH:
            raise YamlProblem("<yaml>", f"{depth} levels", f"nested too deeply (at most "
                              f"{MAX_YAML_DEPTH})")
        _check_nodes(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _expanded_size(root: yaml.Node, limit: int) -> tuple[int, int]:
    """Nodes in the document once every alias is expanded (limit + 1 once past `limit`, or if
    an alias contains itself), and its depth. Each distinct node is sized once; no
    recursion."""
    sizes: dict[int, tuple[int, int]] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        children = _children(node)
        if children_done:
            on_path.discard(key)
            below = [sizes[id(child)] for child in children]
            sizes[key] = (1 + sum(s for s, _ in below), 1 + max((d for _, d in below),
                                                                 default=0))
            if sizes[key][0] > limit:
                return limit + 1, sizes[key][1]
        elif key in on_path:
            return limit + 1, 0  # recursive alias: infinite once expanded
        elif key not in sizes:
            on_path.add(key)
            stack.append((node, True))
            stack.extend((child, False) for child in children if id(child) not in sizes)
    return sizes[id(root)]


def _has_alias(root: yaml.Node) -> bool:
    """Whether a node is reached twice: an alias names an anchored node, shared in the graph."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            return True
        seen.add(id(node))
        stack.extend(_children(node))
    return False


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


def read_base(path: Path, data: dict[str, Any]
              ) -> tuple[dict[str, Any], Path, Path | None]:
    """The `base` scenario of a sweep or comparison file `path` (its mapping `data`): given
    inline, or as a scenario file relative to `path`; the folder its relative paths are read
    from (the scenario file's own, or `path`'s); and that scenario file (None if inline),
    which names the base's own problems."""
    base, base_dir, base_path = data.get("base"), path.parent, None
    if isinstance(base, str):
        base_path = base_dir / base
        base, base_dir = read_yaml(base_path), base_path.parent
    if not isinstance(base, dict):
        raise InputError(path, "base", base, "must be a scenario file or mapping")
    return base, base_dir, base_path


def _check_nodes(root: yaml.Node) -> None:
    """Every mapping key is text (`<<` merges aside), given once in its mapping; no integer
    is longer than MAX_INT_DIGITS digits; every number is plain decimal. Each distinct node is
    read once; no recursion."""
    seen_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, str]] = [(root, "")]
    while stack:
        node, where = stack.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        line = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            keys: set[str] = set()
            for key, value in node.value:
                if key.tag == _MERGE:
                    stack.append((value, where))
                    continue
                if key.tag != _STR or not isinstance(key, yaml.ScalarNode):
                    at = key.start_mark.line + 1
                    if not isinstance(key, yaml.ScalarNode):
                        raise YamlProblem(f"{where}? (line {at})", "?",
                                          "a key must be text, not a list or mapping")
                    # 1 and '1' would both name variant 1: a comparison would keep one.
                    kind = _KINDS.get(key.tag, f"a value tagged {key.tag}")
                    raise YamlProblem(f"{where}{key.value} (line {at})", key.value,
                                      f"a key must be text, and YAML reads this one as "
                                      f"{kind}: quote it ('{key.value}')")
                if key.value in keys:
                    raise YamlProblem(f"{where}{key.value} (line {key.start_mark.line + 1})",
                                      key.value, "given twice in one mapping (YAML would "
                                      "silently keep the last)")
                keys.add(key.value)
                stack.append((value, f"{where}{key.value}."))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, f"{where}{i}.") for i, item in enumerate(node.value))
        elif node.tag == _INT:
            digits = len(_digits(node.value))
            if digits > MAX_INT_DIGITS:
                raise YamlProblem(f"{where.rstrip('.') or '<top level>'} (line {line})",
                                  node.value, f"an integer of {digits} digits (at most "
                                  f"{MAX_INT_DIGITS})")
        if node.tag in (_INT, _FLOAT) and isinstance(node, yaml.ScalarNode):
            problem = _not_plain(node)
            if problem:
                raise YamlProblem(f"{where.rstrip('.') or '<top level>'} (line {line})",
                                  verbatim(node.value), problem)


def _not_plain(node: yaml.ScalarNode) -> str | None:
    """Why a number literal is not plain decimal (None if it is), with what YAML 1.1 makes of
    it. Its digits are already bounded, so constructing it is cheap. An explicit tag on a
    non-number (`!!int abc`) is refused here too, where PyYAML would raise a ValueError."""
    text = node.value
    if node.tag == _INT and _PLAIN_INT.fullmatch(text):
        return None
    if node.tag == _FLOAT and "_" not in text and ":" not in text:
        construct = _CONSTRUCT.construct_yaml_float
        form = None
    else:
        bare = text.lstrip("+-").replace("_", "")
        construct = (_CONSTRUCT.construct_yaml_int if node.tag == _INT
                     else _CONSTRUCT.construct_yaml_float)
        form = ("the base-60 number" if ":" in bare else
                "the binary number" if bare[:2].lower() == "0b" else
                "the hexadecimal number" if bare[:2].lower() == "0x" else
                "the octal number" if node.tag == _INT and bare[:1] == "0" else
                "the number")
    try:
        value = construct(node)
    except (ValueError, IndexError):
        return f"tagged as a number, but {text!r} is not one YAML reads"
    if form is None:
        return None
    return f"YAML 1.1 reads {text} as {form} {value}: write it in plain decimal"


def _digits(literal: str) -> str:
    """The digits of a YAML 1.1 integer literal (`-1_000`, `0x1F`, `1:30`)."""
    text = literal.lstrip("+-").replace("_", "").replace(":", "")
    return text[2:] if text[:2].lower() in ("0x", "0o", "0b") else text

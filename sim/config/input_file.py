"""Reading a file the user named: only a regular file is opened, its size is bounded, and JSON is
parsed strictly. One set of rules for every input reader (traces, model configs, profiles,
network tables, hashes of inputs), so a named pipe never hangs a run, a directory or a missing
file never ends in a traceback, and a JSON document never means something other than it says.

Functions raise `FileProblem`, whose text is the problem alone ("not a regular file (a named
pipe or a device)"); `check_regular` and `read_json_file` wrap it in an `InputError` naming the
file and field.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from stat import S_ISDIR, S_ISREG
from typing import Any, BinaryIO

from sim.config.errors import InputError

# Integers in our inputs are counts and token numbers: 30 digits is far past any of them, and a
# 5,000-digit literal neither parses in Python (it refuses > 4,300 digits) nor converts to float.
MAX_INT_DIGITS = 30


class FileProblem(ValueError):
    """What is wrong with a file or its content, without the file's name."""


def is_utf8_name(path: Path) -> bool:
    """Whether a path's name is UTF-8, as pyarrow needs to read or write it (bytes that are
    not are kept by Python as surrogates, which do not encode)."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def stat_regular(path: Path) -> os.stat_result:
    """`path`'s stat, if it is a regular file (symlinks followed)."""
    try:
        stat = path.stat()
    except ValueError:  # the system takes no NUL in a name
        raise FileProblem("not a file name: it holds a NUL character") from None
    except FileNotFoundError:
        raise FileProblem("file not found") from None
    except OSError as exc:  # a name too long, a component that is a file, no permission
        raise FileProblem(f"cannot read it: {exc.strerror}") from None
    if S_ISDIR(stat.st_mode):
        raise FileProblem("is a directory, not a file")
    if not S_ISREG(stat.st_mode):
        raise FileProblem("not a regular file (a named pipe or a device)")
    return stat


@contextlib.contextmanager
def open_regular(path: Path) -> Iterator[BinaryIO]:
    """Regular file `path`, open for reading bytes. Opened without blocking and checked again
    once open, so a file swapped for a named pipe since it was looked at neither hangs the open
    nor is read. FileProblem for what `stat_regular` refuses or an open that fails."""
    stat_regular(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise FileProblem(f"cannot read it: {exc.strerror}") from None
    with open(fd, "rb") as f:
        if not S_ISREG(os.fstat(f.fileno()).st_mode):
            raise FileProblem("not a regular file (a named pipe or a device)")
        yield f


def read_bytes(path: Path, max_bytes: int) -> bytes:
    """The content of regular file `path` (see `open_regular`), refused past `max_bytes`."""
    try:
        with open_regular(path) as f:
            raw = f.read(max_bytes + 1)
    except OSError as exc:
        raise FileProblem(f"cannot read it: {exc.strerror}") from None
    if len(raw) > max_bytes:
        raise FileProblem(f"too large (more than {max_bytes:,} bytes are not read)")
    return raw


def check_regular(path: Path, source: str | Path | None, field: str) -> os.stat_result:
    """`stat_regular`, with its problem as an InputError naming `source` and `field`."""
    try:
        return stat_regular(path)
    except FileProblem as exc:
        raise InputError(source, field, str(path), str(exc)) from None


def loads(raw: bytes | str) -> Any:
    """JSON, strictly: a key given twice in one object, NaN or Infinity, a number too large for a
    float or of more than MAX_INT_DIGITS digits, or nesting past Python's recursion limit is a
    FileProblem, not a value (`json.loads` keeps the last key and takes the rest)."""
    # Numbers parsed by json's C scanner, then checked in bulk, cost less than a Python call
    # for each (a Mooncake trace's lines are mostly integers: its 12k lines parse in 95-109
    # ms, not 127-154). What the check cannot vouch for, and every error, goes through the
    # parse that checks each number as it reads it. So does a document with many brackets:
    # that parse's hook is one call deeper, so near the recursion limit only it refuses.
    brackets = raw.count(b"[") + raw.count(b"{") if isinstance(raw, bytes) else \
        raw.count("[") + raw.count("{")
    if brackets <= MAX_BULK_BRACKETS:
        try:
            value = json.loads(raw, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
        except (ValueError, RecursionError):  # JSON and decoding errors too: worded below
            pass
        else:
            if _numbers_within(value):
                return value
    return _loads_checking_each_number(raw)


# Fewer brackets than this cannot nest deep enough to reach Python's recursion limit (1,000
# by default) from any reasonable caller: both parses then read a document alike.
MAX_BULK_BRACKETS = 500


def _numbers_within(value: Any) -> bool:
    """Whether every number in `value` lies strictly between -10**MAX_INT_DIGITS and
    10**MAX_INT_DIGITS: an integer then has at most MAX_INT_DIGITS digits and a float is finite,
    as the checking parse requires (a larger finite float is its to accept)."""
    bound = _BOUND
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is dict:
            stack.extend(item.values())
        elif kind is list:
            if not item:
                continue
            try:  # a list of numbers: two comparisons in C
                if not (-bound < min(item) and max(item) < bound):
                    return False
            except TypeError:  # text, lists or objects among them: one by one
                stack.extend(item)
        elif (kind is int or kind is float) and not -bound < item < bound:
            return False
    return True


_BOUND = 10**MAX_INT_DIGITS


def _loads_checking_each_number(raw: bytes | str) -> Any:
    try:
        return json.loads(raw, object_pairs_hook=_unique_keys, parse_constant=_no_constant,
                          parse_int=_bounded_int, parse_float=_finite_float)
    except UnicodeDecodeError:
        raise FileProblem("not JSON (not UTF-8 text)") from None
    except json.JSONDecodeError as exc:
        raise FileProblem(f"not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
                          ) from None
    except RecursionError:
        raise FileProblem("not JSON (nested too deeply)") from None


def read_json_file(path: Path, source: str | Path | None, field: str,
                   max_bytes: int) -> Any:
    """The JSON document in regular file `path` (see `loads`), problems as an InputError naming
    `source` (the file itself if None) and `field`."""
    try:
        return loads(read_bytes(path, max_bytes))
    except FileProblem as exc:
        raise InputError(path if source is None else source, field, str(path),
                         str(exc)) from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            shown = key if key.isprintable() else repr(key)
            raise FileProblem(f"{shown}={_short(out[key])}, then {_short(value)}: given twice "
                              "in one object (JSON readers would silently keep the last)")
        out[key] = value
    return out


def _no_constant(name: str) -> float:
    raise FileProblem(f"not JSON ({name} is not a JSON number)")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise FileProblem(f"an integer of {len(text.lstrip('-'))} digits (at most "
                          f"{MAX_INT_DIGITS})")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise FileProblem(f"the number {text[:40]} is too large for a float")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."

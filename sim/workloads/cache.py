"""Reading trace tables: CSV through pyarrow's reader, each large CSV parsed once and kept as a
parquet file in a cache directory; JSON lines through the json module. Neither imports pandas.

A cached table is named by the sha256 of the CSV's content, the parser's version (ours and
pyarrow's) and the columns read, so an edited trace is parsed again and a stale entry is never
read. The content is hashed on every load (memoised per process on path, size and modification
time, shared with the sweep's cache keys): a modification time alone can lie (`cp -p`, `rsync
-t`, coarse clocks), and hashing costs a small part of parsing (about 0.5 s a GB). Entries are
written to a temporary file and renamed, so an interrupted run or two workers writing at once
never leave half a file; an unreadable entry is parsed again and replaced.

The directory is `$SERVESIM_CACHE_DIR/traces`, else `$XDG_CACHE_HOME/servesim/traces`, else
`~/.cache/servesim/traces`. It may be deleted at any time. Files under `MIN_CACHED_BYTES` are
parsed every time: that takes milliseconds. It holds at most `$SERVESIM_CACHE_MAX_GB`
(default `DEFAULT_MAX_GB`) of entries: each new entry evicts the least recently used ones (a
hit refreshes an entry's modification time) with their lock files, and lock files left
without an entry for an hour go too.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import math
import os
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from sim.config.errors import InputError
from sim.config.file_hash import file_sha256
from sim.config.input_file import FileProblem, check_regular, is_utf8_name, loads, open_regular
from sim.results.outdir import replace_file
from sim.workloads.table import TraceTable, csv_line, from_arrow, from_rows, numpy_column

if TYPE_CHECKING:
    import pyarrow as pa

# Bump when what `_parse_csv` returns for the same bytes changes.
PARSER_VERSION = 2
MIN_CACHED_BYTES = 1 << 20
CHUNK_BYTES = 1 << 20
DEFAULT_MAX_GB = 5.0  # a few parsed week-long traces (parquet is about a third of the CSV)
ORPHAN_LOCK_AGE_S = 3600.0  # a lock file without an entry this old is no parse in progress
ENVIRONMENT = "<environment>"  # the source named by errors in environment variables


def cache_dir() -> Path:
    """Where parsed traces are kept (see the module's docstring)."""
    if root := os.environ.get("SERVESIM_CACHE_DIR"):
        return Path(root) / "traces"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "servesim" / "traces"


def read_table(path: Path, kind: Literal["csv", "jsonl"], field: str,
               columns: Collection[str] | None = None) -> TraceTable:
    """A CSV or JSON-lines file with at least one row, with only `columns` (all if None) for a
    CSV; errors name the file. The table says how row positions map to lines (`base.line_of`)."""
    check_file(path, field)
    table = _read_jsonl(path, field) if kind == "jsonl" else _read_csv(path, field, columns)
    if table.empty:
        raise InputError(path, field, str(path), "holds no requests (no rows)")
    return table


def check_file(path: Path, field: str) -> None:
    """A trace must be a regular file, not empty: a named pipe or a device would block or never
    end, and a directory or a missing file is named in one line."""
    if check_regular(path, path, field).st_size == 0:
        raise InputError(path, field, str(path), "empty file")


def csv_header(path: Path, field: str) -> list[str]:
    """The column names on a CSV file's first line (the file checked first)."""
    check_file(path, field)
    try:
        with open_regular(path) as raw, \
                io.TextIOWrapper(raw, encoding="utf-8-sig", newline="") as file:
            return next(csv.reader(file), [])
    except FileProblem as exc:
        raise InputError(path, field, str(path), str(exc)) from None
    except UnicodeDecodeError:
        raise InputError(path, field, str(path), "not UTF-8 text") from None
    except csv.Error as exc:
        raise InputError(path, field, str(path), f"cannot parse as csv: {exc}") from None


def _read_csv(path: Path, field: str, columns: Collection[str] | None) -> TraceTable:
    header = csv_header(path, field)
    if columns is None:
        chosen = header
    else:
        missing = [name for name in columns if name not in header]
        if missing:
            raise InputError(path, f"column {missing[0]!r}", header, "missing")
        chosen = [name for name in header if name in columns]  # in the file's order
    for name in dict.fromkeys(chosen):
        if (count := header.count(name)) > 1:
            # pyarrow would read both, and which one a column check or `where` saw is anyone's
            # guess: the file must say which it means.
            raise InputError(path, f"column {name!r}", header,
                             f"named {count} times on line 1: rename all but one")
    # Numpy columns from arrow's buffers: `to_pandas` would import pandas (see `table.py`).
    return from_arrow(_cached(path, field, chosen), path)


def _cached(path: Path, field: str, columns: list[str]) -> pa.Table:
    """The parsed columns, from the cache when an entry for this content exists. One process
    parses while others wanting the same entry wait (sweep workers start together), then read."""
    import pyarrow as pa

    if path.stat().st_size < MIN_CACHED_BYTES:
        return _parse_csv(path, field, columns)
    variant = json.dumps([PARSER_VERSION, pa.__version__, columns])
    key = hashlib.sha256(variant.encode()).hexdigest()[:16]
    entry = cache_dir() / f"{file_sha256(path, source=str(path), field=field)}-{key}.parquet"
    max_bytes = max_cache_bytes()
    if (table := _read_entry(entry)) is not None:
        return table
    with _lock(entry):
        if (table := _read_entry(entry)) is not None:
            return table
        table = _parse_csv(path, field, columns)
        with contextlib.suppress(OSError):  # a read-only or full disk costs speed only
            _write_atomically(table, entry)
            prune(entry.parent, max_bytes, keep=entry)
    return table


def max_cache_bytes() -> int:
    """The cache's size limit: `$SERVESIM_CACHE_MAX_GB` GB (decimal), else the default."""
    value = os.environ.get("SERVESIM_CACHE_MAX_GB")
    if value is None:
        return int(DEFAULT_MAX_GB * 1e9)
    try:
        gb = float(value)
    except ValueError:
        gb = math.nan
    if not (gb >= 0 and math.isfinite(gb * 1e9)):  # NaN fails too
        raise InputError(ENVIRONMENT, "SERVESIM_CACHE_MAX_GB", value,
                         "must be a size in GB, 0 or more")
    return int(gb * 1e9)


def prune(folder: Path, max_bytes: int, keep: Path | None = None) -> list[Path]:
    """Delete the least recently used entries of `folder` (oldest modification time first,
    never `keep`) until the rest hold at most `max_bytes`, with their lock files, and lock files
    and temporary files left for `ORPHAN_LOCK_AGE_S` without an entry or a writer; return the
    entries deleted. Files another process deletes meanwhile are skipped."""
    entries = []
    for item in folder.glob("*.parquet"):
        with contextlib.suppress(OSError):
            stat = item.stat()
            entries.append((stat.st_mtime, item.name, stat.st_size, item))
    entries.sort()
    total = sum(size for _, _, size, _ in entries)
    deleted = []
    for _, _, size, item in entries:
        if total <= max_bytes:
            break
        if item == keep:
            continue
        with contextlib.suppress(OSError):
            item.unlink()
            deleted.append(item)
        total -= size
    now = time.time()
    # Temporary files of a writer killed before it could remove them (`replace_file`).
    for tmp in folder.glob(".*.parquet.*.tmp"):
        with contextlib.suppress(OSError):
            if now - tmp.stat().st_mtime > ORPHAN_LOCK_AGE_S:
                tmp.unlink()
    for lock in folder.glob("*.parquet.lock"):
        entry = lock.with_name(lock.name.removesuffix(".lock"))
        with contextlib.suppress(OSError):
            if not entry.exists() and (
                    entry in deleted or now - lock.stat().st_mtime > ORPHAN_LOCK_AGE_S):
                lock.unlink()
    return deleted


def _read_entry(entry: Path) -> pa.Table | None:
    """The cached table, or None when absent or unreadable (it is then parsed and replaced)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        # Not `pq.read_table`: it imports pyarrow.dataset, which imports pandas (see `table.py`).
        with pq.ParquetFile(entry) as file:
            table = file.read()
    except (OSError, pa.ArrowException):
        return None
    with contextlib.suppress(OSError):
        os.utime(entry)  # used now: the last to be evicted
    return table


@contextlib.contextmanager
def _lock(entry: Path) -> Iterator[None]:
    """An exclusive lock on `<entry>.lock` (released when its process ends, however), or none
    where locks or the directory are not to be had."""
    try:
        import fcntl

        entry.parent.mkdir(parents=True, exist_ok=True)
        file = open(entry.with_name(entry.name + ".lock"), "a")  # noqa: SIM115
    except (ImportError, OSError):
        yield
        return
    with file:
        fcntl.flock(file, fcntl.LOCK_EX)
        yield


def _parse_csv(path: Path, field: str, columns: list[str]) -> pa.Table:
    """Every row of `columns`, with pyarrow's type inference (ints, floats, ISO 8601 times,
    strings). Values it cannot type stay text, for the column checks to name."""
    import pyarrow as pa
    import pyarrow.csv as pcsv

    if not is_utf8_name(path):
        raise InputError(path, field, str(path), "not a UTF-8 file name, which the CSV reader "
                         "(pyarrow) needs: rename the file or its folder")
    try:
        table = pcsv.read_csv(path, convert_options=pcsv.ConvertOptions(include_columns=columns))
    except pa.ArrowInvalid as exc:
        problem = " ".join(str(exc).split())  # one line
        raise InputError(path, field, str(path), f"cannot parse as csv: {problem}") from None
    if any(pa.types.is_binary(t) for t in table.schema.types):
        raise InputError(path, field, str(path), "not UTF-8 text")
    _check_decimal(path, table)
    return table


# pyarrow reads `0x10` as the integer 16. A trace's counts and times are written in decimal, so
# such a value is a column that is not what it seems, not a number to take.
_HEX = r"^\s*[+-]?0[xX]"


def _check_decimal(path: Path, table: pa.Table) -> None:
    """Refuse a value pyarrow read as a hexadecimal integer, naming its line. The integer
    columns are read again as text only when the file holds `0x` at all (a scan at GB/s)."""
    import pyarrow as pa

    integers = [f.name for f in table.schema if pa.types.is_integer(f.type)]
    if not integers or not _holds_hex_prefix(path):
        return
    # (Imported only here: `pyarrow.compute` takes about 0.07 s to import, a tenth of a
    # small run.)
    import pyarrow.compute as pc
    import pyarrow.csv as pcsv

    text = pcsv.read_csv(path, convert_options=pcsv.ConvertOptions(
        include_columns=integers, column_types=dict.fromkeys(integers, pa.string())))
    for name in integers:
        matches = pc.match_substring_regex(text.column(name), _HEX)
        # From the buffers (`to_numpy` imports pandas); text is read without nulls.
        hexadecimal = numpy_column(matches)
        if hexadecimal is None:
            hexadecimal = matches.to_numpy(zero_copy_only=False)
        if hexadecimal.any():
            row = int(hexadecimal.argmax())
            raise InputError(path, f"{name} (line {csv_line(path, row)})",
                             text.column(name)[row].as_py(),
                             "not a decimal number (hexadecimal is not read)")


def _holds_hex_prefix(path: Path) -> bool:
    with open_regular(path) as f:
        tail = b""
        while chunk := f.read(CHUNK_BYTES):
            block = tail + chunk
            if b"0x" in block or b"0X" in block:
                return True
            tail = chunk[-1:]
    return False


def _write_atomically(table: pa.Table, entry: Path) -> None:
    import pyarrow.parquet as pq

    # snappy: a third of the CSV's size, read at ~0.3 GB/s
    replace_file(entry, lambda tmp: pq.write_table(table, tmp))


def _read_jsonl(path: Path, field: str) -> TraceTable:
    """One JSON object per line (blank lines skipped), read as strictly as every JSON input
    (`sim.config.input_file.loads`: a key given twice, NaN, huge integers, deep nesting are
    refused); errors give the line number. No pandas: see `sim.workloads.table`."""
    rows, lines = [], []
    try:
        with open_regular(path) as raw, io.TextIOWrapper(raw, encoding="utf-8") as file:
            for number, line in enumerate(file, start=1):
                line = line.strip()
                if not line:
                    continue
                try:
                    row = loads(line)
                except FileProblem as exc:
                    # One line is one document: its own "line 1" would contradict the field's.
                    problem = str(exc).replace(" at line 1 column ", " at column ")
                    raise InputError(path, f"line {number}", line, problem) from None
                if not isinstance(row, dict):
                    raise InputError(path, f"line {number}", row, "must be a JSON object")
                rows.append(row)
                lines.append(number)
    except FileProblem as exc:
        raise InputError(path, field, str(path), str(exc)) from None
    except UnicodeDecodeError:
        raise InputError(path, field, str(path), "not UTF-8 text") from None
    return from_rows(rows, lines)


"""Result directories that are whole or absent: checked before a run starts, written into a
temporary sibling, then swapped into place. An interrupt or a crash leaves the previous results
(or nothing) and never a directory that mixes two runs or looks complete when it is not.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from sim.config.errors import InputError
from sim.config.input_file import is_utf8_name
from sim.results.interrupts import on_sigint

# A directory holding this file is a servesim run and may be replaced by a new run.
RUN_MARKER = "summary.json"
# ... and one holding this, replications of a run (`sim.studies.replications.RESULT_FILE`): replaced
# whole by a single run too, as a run is by replications.
REPLICATIONS_MARKER = "replications.json"


class SwappedInterrupt(KeyboardInterrupt):
    """Ctrl-C that arrived while new results were being swapped in: the swap was finished
    first, so the new results are in place and whole (not the previous ones)."""

REPORT_FILE = "report.html"  # what `servesim report` writes into a result directory
# What `plot`, `report` and `export` read back from a result directory (a run, replications,
# a sweep, a comparison, a capacity search): never the file one of them writes.
RESULT_FILES = frozenset({
    RUN_MARKER, REPLICATIONS_MARKER, "requests.parquet", "iterations.parquet", "tokens.parquet",
    "tbt_gaps.parquet", "scenario.yaml", "inputs.json", "sweep.json", "results.parquet",
    "results.csv", "capacity.json", "trials.csv", "comparison.csv",
    "comparison_replications.csv"})
PLOTS_DIR = "plots"  # what `servesim plot` draws into
EXPORT_FILES = frozenset({"vllm_result.json", "trace.json"})  # `sim.export.DEFAULT_FILES`
# What servesim writes into a run's or replications' directory, beside the `plots` folder and
# (replications) the `rep<k>` runs: a new run may replace only these.
RUN_FILES = RESULT_FILES | {REPORT_FILE} | EXPORT_FILES
_REP = re.compile(r"rep[0-9]+")
_TEMPORARY = re.compile(r"\.tmp$|\.(tmp|old|check)-[^/]+$")


# Files that mark a directory as results of some kind (a run, replications, a sweep, a
# capacity search, a comparison).
RESULT_MARKERS = (RUN_MARKER, REPLICATIONS_MARKER, "sweep.json", "capacity.json",
                  "comparison.csv")


def check_not_a_result_file(out: Path, results: Path, field: str = "--out") -> None:
    """Refuse to write `out` over a file of the result directory `results` (or of one inside
    it) that the results are read from: an export or a report there would destroy the run;
    and anywhere inside other results (another run's directory, its plots, a sweep's runs),
    which belong to those."""
    try:
        target, own = out.resolve(), results.resolve()
    except (OSError, RuntimeError):
        return  # unresolvable: the write itself reports the problem
    if target.is_relative_to(own):
        if out.name in RESULT_FILES and out.exists():
            raise InputError(out, field, str(out), "is one of the results' own files, "
                             "which this would overwrite: name another file")
        return
    # The directory it would land in and two above it (a run's `plots`, a sweep's runs).
    for directory in list(target.parents)[:3]:
        if any((directory / marker).is_file() for marker in RESULT_MARKERS):
            raise InputError(out, field, str(out), f"is inside other results ({directory}), "
                             "whose files this would change: write it elsewhere")


def is_run_dir(path: Path) -> bool:
    return (path / RUN_MARKER).is_file()


def is_replications_dir(path: Path) -> bool:
    return (path / REPLICATIONS_MARKER).is_file()


def is_earlier_results(path: Path) -> bool:
    """A single run's or replications' directory: what a new run may replace whole."""
    return is_run_dir(path) or is_replications_dir(path)


def check_out_dir(out: Path, field: str = "--out") -> None:
    """Fail now, before any simulation, if results could not be written to `out`: it is a file,
    a directory that is not an earlier run or earlier replications (never replaced), one that
    holds something no run writes (replacing it would delete that), or in a place we cannot
    write."""
    check_writable_dir(out, field)
    if out.is_dir() and any(out.iterdir()) and not is_earlier_results(out):
        raise InputError(out, field, str(out), f"exists, is not empty and holds no {RUN_MARKER} "
                         f"or {REPLICATIONS_MARKER} (not an earlier run); refusing to replace "
                         "it: choose another directory")
    check_only_results(out, field)


def check_only_results(out: Path, field: str = "--out") -> None:
    """`out`, an earlier run or earlier replications (or absent), holds nothing but what servesim
    writes there, which a new run may replace whole: anything else (a run nested in it, a user's
    notes) is refused, naming the entry."""
    if not out.is_dir():
        return
    what = "the earlier replications" if is_replications_dir(out) else "the earlier run"
    foreign = foreign_entry(out)
    if foreign is not None:
        raise InputError(out, field, str(out), f"holds {foreign!r}, which no run "
                         f"writes: replacing {what} would delete it; move it, or choose another "
                         "directory")


def foreign_entry(out: Path) -> str | None:
    """The first entry of the run or replications directory `out` (in name order) that servesim
    does not write there, as a path relative to `out`; None where there is none. A replication's
    `rep<k>` folder is looked into, as a run of its own."""
    for entry in sorted(out.iterdir(), key=lambda e: e.name):
        name = entry.name
        if entry.is_symlink():
            return name  # never written by servesim; replacing the run would drop the link
        if entry.is_file() and (name in RUN_FILES or is_leftover(name)):
            continue
        if entry.is_dir() and (name == PLOTS_DIR or is_leftover(name)):
            continue
        if entry.is_dir() and _REP.fullmatch(name) and is_replications_dir(out) \
                and is_run_dir(entry):
            inner = foreign_entry(entry)
            if inner is None:
                continue
            return f"{name}/{inner}"
        return name
    return None


def is_leftover(name: str) -> bool:
    """A temporary that servesim itself names (`replace_file`'s `.NAME.XXXX.tmp`, a directory's
    `.NAME.tmp-XXXX`), left by a crash, or the Finder's `.DS_Store`: the only entries starting
    with '.' that replacing a result directory may delete (any other is a user's)."""
    return name == ".DS_Store" or (name.startswith(".") and _TEMPORARY.search(name) is not None)


def check_writable_dir(out: Path, field: str = "--out") -> None:
    """`out` can be a directory we write in: not empty, not the current directory or one above
    it, not a file or below one, not a symbolic link to nothing, a name the system takes, and
    writable (its parents are created)."""
    if not is_utf8_name(out):
        raise InputError(out, field, str(out), "not a UTF-8 name, which the parquet writer "
                         "(pyarrow) needs: name another directory")
    if str(out) in ("", ".") or Path(os.path.abspath(out)) in (Path.cwd(), *Path.cwd().parents):
        raise InputError(out, field, str(out), "is the current directory or above it: name a "
                         "directory of its own")
    try:
        exists = out.exists()
    except OSError as exc:  # a name too long (Path.exists raises for it), no permission
        raise InputError(out, field, str(out), f"cannot use it: {exc.strerror}") from None
    if exists and not out.is_dir():
        raise InputError(out, field, str(out), "exists and is not a directory")
    if not exists and out.is_symlink():
        # The results would replace the link only once the run is done, and fail there.
        raise InputError(out, field, str(out), f"a symbolic link to {os.readlink(out)!r}, "
                         "which does not exist: name a directory")
    parent = out.absolute().parent
    existing = parent
    while not os.path.exists(existing):
        existing = existing.parent
    if not existing.is_dir():
        raise InputError(out, field, str(out), f"{shown_path(existing)} is a file, not a "
                         "directory")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryDirectory(dir=parent, prefix=f".{out.name}.check-").cleanup()
    except OSError as exc:
        raise InputError(out, field, str(out), f"cannot write there: {exc.strerror}") from None


def shown_path(path: str | Path) -> str:
    """`path` inside an error's text: as it is, or quoted where it holds a newline or another
    character that would break the line (`InputError` quotes its source so itself)."""
    text = str(path)
    return text if text.isprintable() else repr(text)


def _umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it: put it back at once
    os.umask(mask)
    return mask


def temporary_dir(out: Path) -> Path:
    """A fresh, empty temporary sibling of `out` to fill and swap in, with the permissions a
    plain `mkdir` gives (mkdtemp's 0700 would hide results from the rest of a team). Its name
    carries this process's id; siblings an earlier, killed process left are removed first."""
    parent = out.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out)
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".{out.name}.tmp-{os.getpid()}-"))
    os.chmod(tmp, 0o777 & ~_umask())
    return tmp


def remove_stale_temporaries(out: Path) -> list[Path]:
    """Remove the temporary siblings of `out` (`.NAME.tmp-PID-...`, `.NAME.old-PID-...`) whose
    process is gone: a run killed (SIGKILL, a crash of the machine) while writing cannot remove
    its own. Those of a live process, and unnamed ones, are left alone. Returns what went."""
    parent = out.absolute().parent
    gone: list[Path] = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return gone
    for entry in entries:
        match = _STALE.fullmatch(entry.name)
        if match is None or match["name"] != out.name or _alive(int(match["pid"])):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        gone.append(entry)
    return gone


_STALE = re.compile(r"\.(?P<name>.+)\.(tmp|old)-(?P<pid>\d{1,10})-[^/]+")


def _alive(pid: int) -> bool:
    """Whether a process `pid` exists (one of another user's counts: not ours to judge)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True
    return True


# Errors of a place results cannot be written to, as opposed to a fault of servesim's.
_CANNOT_WRITE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES,
                           errno.EPERM})


@contextlib.contextmanager
def _refused_writes(path: Path, field: str, problem: str, kept: str) -> Iterator[None]:
    """A write the place refuses (the disk filled up, or it became unwritable, after it was
    checked) as one line naming `path`; any other OSError is a fault of servesim's, raised
    as it is."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in _CANNOT_WRITE:
            raise
        raise InputError(path, field, str(path), f"{problem}: {os.strerror(exc.errno)}; "
                         f"{kept}") from None


def write_dir(out: Path, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp)` to fill a fresh temporary sibling of `out`, then put it in `out`'s place
    (replacing an earlier run there whole). On any failure or interrupt `out` is unchanged."""
    check_out_dir(out)
    tmp = temporary_dir(out)
    try:
        with _refused_writes(out, "--out", "cannot write the results there",
                             "nothing was replaced"):
            write(tmp)
            swap_in(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def swap_in(tmp: Path, out: Path) -> None:
    """Put the filled directory `tmp` (a sibling of `out`) in `out`'s place, replacing what is
    there whole. Ctrl-C waits for the renames, then raises `SwappedInterrupt`: the new results
    are in place."""
    with _interrupts_deferred():
        if out.exists():
            old = Path(tempfile.mkdtemp(dir=tmp.parent, prefix=f".{out.name}.old-{os.getpid()}-"))
            os.replace(out, old / "run")
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Hold Ctrl-C for the few renames that swap a directory in; after them, raise
    `SwappedInterrupt` (the swap is done)."""
    caught: list[bool] = []
    with on_sigint(lambda: caught.append(True)):
        yield
    if caught:
        raise SwappedInterrupt


def replace_file(path: Path, write: Callable[[Path], object]) -> None:
    """`write(tmp)` into a fresh temporary file beside `path`, then renamed onto it: `path` is
    the old file or the new one, whole, never part of one, and two writers never share the
    temporary (an interrupt or failure removes it). Entries created 0644, as open() would."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        with _refused_writes(path, "<file>", "cannot write it",
                             "the earlier file, if any, is kept"):
            write(tmp)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def replace_text(path: Path, text: str) -> None:
    """`replace_file` with `text` as the content."""
    replace_file(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))

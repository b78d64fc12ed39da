"""The content hash of an input file (a trace, a lengths file, a fitted latency profile) or of a
replay's result directory: what a run's answer depends on (`sim.results.fingerprint`), and the
trace cache's key (`sim.workloads.cache`). Each file is read once per process.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

from sim.config.errors import InputError
from sim.config.input_file import FileProblem, check_regular, open_regular

CHUNK_BYTES = 1 << 20
# A replay's result directory (the recorded latency model's input) holds a handful of files.
RECORDED_FILE = "iterations.parquet"
MAX_TREE_ENTRIES = 10_000


def file_sha256(path: Path, *, source: str | None = None, field: str = "<file>") -> str:
    """The sha256 of a file's content; each file is read once per process (memoised on its
    path, size and modification time, so an edited file is hashed again). Only a regular file
    is read (a named pipe would block, a device never end). A directory is hashed only as a
    replay's result directory (the recorded latency model's input): the hash of its files'
    relative names and hashes (hidden ones aside)."""
    try:
        if path.is_dir():
            return _tree_sha256(path, source, field)
        stat = check_regular(path, source, field)
        return _sha256(str(path.absolute()), stat.st_size, stat.st_mtime_ns)
    except FileProblem as exc:  # a file swapped for a pipe since it was looked at
        raise InputError(source, field, str(path), str(exc)) from None
    except OSError as exc:
        raise InputError(source, field, str(path), f"cannot read it: {exc.strerror}") from None


def _tree_sha256(root: Path, source: str | None, field: str) -> str:
    digest = hashlib.sha256()
    for path in _tree_files(root, source, field):
        stat = path.stat()
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(_sha256(str(path.absolute()), stat.st_size, stat.st_mtime_ns).encode())
    return digest.hexdigest()


def _tree_files(root: Path, source: str | None, field: str) -> list[Path]:
    """The files of a replay's result directory, sorted, hidden ones aside. Any other directory
    is refused, and so is one of more than MAX_TREE_ENTRIES entries: hashing a tree such as
    /usr given by mistake would read it all before the run found it is no input."""
    if not (root / RECORDED_FILE).is_file():
        raise InputError(source, field, str(root), f"a directory without {RECORDED_FILE}: "
                         "only a replay's result directory is read as a directory")
    files = []
    for count, path in enumerate(root.rglob("*"), start=1):
        if count > MAX_TREE_ENTRIES:
            raise InputError(source, field, str(root), f"more than {MAX_TREE_ENTRIES:,} "
                             "entries: not a replay's result directory")
        relative = path.relative_to(root)
        # is_file: regular files only (a pipe or a device inside is not part of the results).
        if not any(part.startswith(".") for part in relative.parts) and path.is_file():
            files.append(path)
    return sorted(files)


def size_bytes(path: Path, source: str | None, field: str) -> int:
    """A file's size, or the total of a replay directory's files."""
    if path.is_dir():
        return sum(p.stat().st_size for p in _tree_files(path, source, field))
    return path.stat().st_size


@lru_cache(maxsize=1024)
def _sha256(path: str, size_bytes: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open_regular(Path(path)) as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()

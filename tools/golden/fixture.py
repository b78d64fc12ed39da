"""The golden fixture file: one gzip-compressed JSON document per workload and engine version.

    engine, engine_version, command: what recorded it and how to record it again;
    workload: the whole workload (`workloads.py`), so a test needs nothing else;
    steps: one [start_s, end_s, scheduled, preempted] per engine step, in order: `scheduled`
        the [request id, tokens] pairs in the scheduler's order, `preempted` the request ids
        preempted while it was built, in order (a step may schedule nothing and only preempt);
    requests: [first_scheduled_s, first_token_s, finish_s, num_preemptions] by request id;
    hicache (SGLang with --enable-hierarchical-cache only): the host tier's record, per step
        (`tools/golden/sglang_hicache.py` `HiCacheLog`).

Written with sorted keys and no timestamps of its own, so recording twice gives the same bytes.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any


def fixture_path(out_dir: Path, engine: str, engine_version: str, name: str) -> Path:
    return out_dir / f"{engine}-{engine_version}" / f"{name}.json.gz"


def write_fixture(out_dir: Path, workload: dict[str, Any], body: dict[str, Any], *,
                  engine: str, engine_version: str, command: str) -> Path:
    path = fixture_path(out_dir, engine, engine_version, workload["name"])
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"engine": engine, "engine_version": engine_version, "command": command,
           "workload": workload, **body}
    data = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    # mtime=0: the same schedule gives the same file.
    path.write_bytes(gzip.compress(data, compresslevel=9, mtime=0))
    return path


def read_fixture(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(gzip.decompress(path.read_bytes()))
    return doc

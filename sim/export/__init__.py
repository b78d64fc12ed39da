"""A run's results in other tools' formats: vLLM's serving-benchmark result file (`vllm.py`)
and the Trace Event Format that Perfetto and chrome://tracing open (`chrome.py`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from sim.config.errors import COMMAND_LINE, InputError
from sim.results.outdir import check_not_a_result_file, replace_text

Format = Literal["vllm", "chrome"]
FORMATS: tuple[Format, ...] = ("vllm", "chrome")
DEFAULT_FILES: dict[Format, str] = {"vllm": "vllm_result.json", "chrome": "trace.json"}


def export_run(run_dir: str | Path, fmt: str, out: str | Path | None = None, *,
               percentiles: Sequence[float] = (99.0,), detailed: bool = True,
               num_flows: int = 20) -> Path:
    """Read the run in `run_dir` and write it as `fmt` to `out` (default: a file in the run
    directory, `DEFAULT_FILES[fmt]`); return the path written. `percentiles` and `detailed`
    (per-request arrays) shape a vllm file, `num_flows` a chrome trace."""
    # Imported here: `sim.export` is imported by the CLI, which starts without pandas.
    from sim.results.run_dir import Results

    if fmt not in FORMATS:
        raise InputError(COMMAND_LINE, "--format", fmt,
                         f"unknown format (choose {', '.join(FORMATS)})")
    path = Path(out) if out is not None else Path(run_dir) / DEFAULT_FILES[fmt]
    if path.is_dir():
        raise InputError(path, "--out", str(path), "is a directory: give a file name")
    check_not_a_result_file(path, Path(run_dir))
    results = Results.load(run_dir)
    if fmt == "vllm":
        from sim.export.vllm import vllm_result

        data = vllm_result(results, percentiles, detailed=detailed)
    else:
        from sim.export.chrome import chrome_trace

        data = chrome_trace(results, num_flows)
    write_json(path, data)
    return path


def write_json(path: Path, data: dict[str, Any]) -> None:
    """`data` as JSON, keys sorted: one top-level key a line, and a list of objects (trace
    events) one object a line, so that `diff` shows what changed. Written whole or not at all;
    an unwritable path is one `InputError` line naming it."""
    lines = []
    for key in sorted(data):
        value = data[key]
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            items = ",\n".join(_dumps(v) for v in value)
            lines.append(f"{json.dumps(key)}: [\n{items}\n]")
        else:
            lines.append(f"{json.dumps(key)}: {_dumps(value)}")
    text = "{\n" + ",\n".join(lines) + "\n}\n"
    try:
        replace_text(path, text)
    except OSError as exc:
        raise InputError(path, "--out", str(path),
                         f"cannot write it ({exc.strerror or type(exc).__name__})") from None


def _dumps(value: Any) -> str:
    # NaN is not JSON: the exporters turn a missing number into null before this.
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)

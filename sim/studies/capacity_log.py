"""A capacity search on disk, as `servesim capacity` writes it: `trials.csv` rewritten after
each run (an interrupted search keeps its trials), then `scenario.yaml` and `capacity.json`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from sim.config.errors import InputError
from sim.config.scenario import Scenario
from sim.results.outdir import check_writable_dir, replace_text
from sim.studies.rate_decision import TARGETS, SLOTargets, Trial

TRIALS_FILE, RESULT_FILE, SCENARIO_FILE = "trials.csv", "capacity.json", "scenario.yaml"


def is_capacity_dir(path: Path) -> bool:
    return (path / TRIALS_FILE).is_file() or (path / RESULT_FILE).is_file()


class CapacityLog:
    """A capacity search on disk: `trials.csv` after each run, `capacity.json` at the end."""

    def __init__(self, out_dir: Path) -> None:
        check_writable_dir(out_dir)
        if out_dir.is_dir() and any(out_dir.iterdir()) and not is_capacity_dir(out_dir):
            raise InputError(out_dir, "--out", str(out_dir), "exists, is not empty and holds "
                             f"no {TRIALS_FILE} (not a capacity search); choose another "
                             "directory")
        self.out_dir = out_dir
        self.trials: list[Trial] = []
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            for name in (RESULT_FILE, SCENARIO_FILE):  # an earlier search's answer
                (out_dir / name).unlink(missing_ok=True)
            self._write_trials()
        except OSError as exc:
            raise InputError(out_dir, "--out", str(out_dir),
                             f"cannot write there: {exc.strerror}") from None

    def add(self, trial: Trial) -> None:
        self.trials.append(trial)
        self._write_trials()

    def _write_trials(self) -> None:
        rows = [{"seed": t.seed, "rate": t.rate, "qps": t.qps, "ok": t.ok,
                 "overload": t.verdict, **t.metrics_s, "violations": "; ".join(t.violations),
                 "latency_scale": t.latency_scale}
                for t in self.trials]
        columns = ["seed", "rate", "qps", "ok", "overload", *TARGETS, "violations",
                   "latency_scale"]
        replace_text(self.out_dir / TRIALS_FILE,
                 pd.DataFrame(rows, columns=columns).to_csv(index=False))

    def finish(self, scenario: Scenario, targets: SLOTargets, precision: float,
               result: dict[str, Any]) -> Path:
        """Write `capacity.json` (what was searched and what was found) after `scenario.yaml`
        (the resolved scenario searched, with any `--set` applied; its rate the starting one)."""
        from sim.config.scenario import scenario_yaml

        replace_text(self.out_dir / SCENARIO_FILE, scenario_yaml(scenario))
        data: dict[str, Any] = {
            "scenario": scenario.name, "source": scenario.source, "knob": result["knob"],
            "targets_s": targets.given(), "precision": precision,
            "capacity": result["capacity"], "capacity_qps": result["capacity_qps"],
            "interval": result["interval"], "interval_qps": result["interval_qps"],
            "ci95_qps": result["ci95_qps"], "interval_meaning": result["interval_meaning"],
            **{key: result[key] for key in ("highest_held", "highest_held_qps",
                                            "saturation_knee", "confidence", "replications",
                                            "seeds", "deterministic", "varies_by",
                                            "num_runs")},
            "rates": [d.record() for d in sorted(result["rates"], key=lambda d: d.rate)],
            **{key: result[key] for key in ("num_gpus", "capacity_qps_per_gpu",
                                            "usd_per_million_tokens",
                                            "usd_per_million_output_tokens")},
            **{key: result[key] for key in ("band", "with_band_qps") if key in result},
        }
        path = self.out_dir / RESULT_FILE
        replace_text(path, json.dumps(data, indent=2) + "\n")
        return path

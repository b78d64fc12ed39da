"""`servesim fit-workload`: a generator fitted to a trace (`sim.studies.fit_workload`), written
as a scenario whose workload is `synthetic` (or `prefix`, for a trace with sessions), with the
fit's report."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.table import Table

from sim.cli.common import app, console, set_option


@app.command("fit-workload")
def fit_workload(
    scenario: Annotated[Path, typer.Argument(
        metavar="SCENARIO", help="a scenario whose workload is the trace to fit (its window, "
                                 "where and num_requests apply)")],
    out: Annotated[Path, typer.Option("--out", help="the scenario to write (YAML): this one "
                                                    "with the fitted workload")],
    set_: Annotated[list[str] | None, set_option("over the scenario file")] = None,
) -> None:
    """Fit a generator to a trace (arrival rate and burstiness, length percentiles and their
    correlation; sessions and a shared prompt where its prefix ids show them); print how close
    it is (KS distances, burstiness, prefix reuse, sessions); write it."""
    from sim.config.errors import COMMAND_LINE, InputError
    from sim.config.overrides import load_scenario, parse_overrides
    from sim.config.scenario import parse_scenario, scenario_yaml
    from sim.results.outdir import replace_text
    from sim.studies.fit_workload import fit_workload as fit

    if out.suffix not in (".yaml", ".yml"):
        raise InputError(COMMAND_LINE, "--out", str(out), "a scenario is a .yaml file")
    loaded = load_scenario(scenario, parse_overrides(set_))
    result = fit(loaded)
    fitted = parse_scenario({**loaded.model_dump(mode="json"), "workload": result.workload},
                            str(out))
    console.print(fit_table(result.report))
    header = "".join(f"# {line}\n" for line in fit_lines(scenario, result.report))
    try:
        replace_text(out, header + scenario_yaml(fitted))
    except OSError as exc:
        raise InputError(COMMAND_LINE, "--out", str(out),
                         f"cannot write there ({exc.strerror or exc})") from None
    knob = ("workload.arrivals.qps=... (sessions started per second)"
            if result.workload["format"] == "prefix" else "workload.arrivals.qps=...")
    console.print(f"written: {out} (run it: servesim simulate {out}; scale it: --set {knob})",
                  soft_wrap=True)


def fit_table(report: dict[str, Any]) -> Table:
    """The fit, as the trace and the fitted generator each show it (80 columns)."""
    table = Table("", "trace", "fitted", "KS distance", box=box.SIMPLE_HEAD,
                  title=f"{report['num_requests']:,} requests over {report['span_s']:,.1f} s: "
                        f"{report['generator']} workload fitted")
    ks = report["ks"]
    table.add_row("prompt tokens", "", "percentiles", f"{ks['prompt_tokens']:.3f}")
    table.add_row("output tokens", "", "percentiles", f"{ks['output_tokens']:.3f}")
    cv = report["burstiness_cv"]
    table.add_row("gaps between arrivals", "", report["arrival_process"] or "",
                  f"{ks['gap_s']:.3f}")
    table.add_row("burstiness (CV of gaps)", f"{cv['trace']:.2f}", f"{cv['fitted']:.2f}", "")
    corr = report["length_rank_correlation"]
    table.add_row("prompt-output rank corr.", _number(corr["trace"]), _number(corr["fitted"]),
                  "")
    if (reuse := report["prefix_block_reuse"]) is not None:
        table.add_row("prefix blocks reused", _share(reuse["trace"]), _share(reuse["fitted"]),
                      "")
    if (sessions := report.get("sessions")) is not None:
        trace, fitted = sessions["trace"], sessions["fitted"]
        table.add_row("requests continuing one", _share(trace["continuing_share"]),
                      _share(fitted and fitted["continuing_share"]), "")
        table.add_row("turns per session P50/max", _turns(trace), _turns(fitted), "")
        table.add_row("gap between turns P50", _seconds(trace), _seconds(fitted), "")
    return table


def fit_lines(source: Path, report: dict[str, Any]) -> list[str]:
    """The fit's report, as the comment heading the written scenario."""
    ks, cv = report["ks"], report["burstiness_cv"]
    lines = [f"servesim fit-workload {source}: {report['num_requests']} requests over "
             f"{report['span_s']:.1f} s; a {report['generator']} workload, "
             f"{report['arrival_process']} arrivals",
             f"KS distance, trace vs fitted: prompt {ks['prompt_tokens']:.3f}, output "
             f"{ks['output_tokens']:.3f}, gaps {ks['gap_s']:.3f}; burstiness (CV of gaps) "
             f"{cv['trace']:.2f} vs {cv['fitted']:.2f}",
             f"prompt-output rank correlation "
             f"{_number(report['length_rank_correlation']['trace'])} vs "
             f"{_number(report['length_rank_correlation']['fitted'])}"]
    if (reuse := report["prefix_block_reuse"]) is not None:
        lines.append(f"prefix blocks reused: {_share(reuse['trace'])} vs {_share(reuse['fitted'])}"
                     + ("" if reuse["fitted"] is not None else
                        " (retime the trace to keep its prefixes)"))
    if (sessions := report.get("sessions")) is not None:
        trace, fitted = sessions["trace"], sessions["fitted"]
        lines.append(f"requests continuing an earlier one: {_share(trace['continuing_share'])} "
                     f"vs {_share(fitted and fitted['continuing_share'])}; turns P50/max "
                     f"{_turns(trace)} vs {_turns(fitted)}; gap between turns P50 "
                     f"{_seconds(trace)} vs {_seconds(fitted)}")
    return lines


def _share(value: float | None) -> str:
    return "none" if value is None else f"{100 * value:.1f}%"


def _turns(shape: dict[str, Any] | None) -> str:
    return "none" if shape is None else f"{shape['turns_p50']:g}/{shape['turns_max']}"


def _seconds(shape: dict[str, Any] | None) -> str:
    gap = None if shape is None else shape["gap_between_turns_p50_s"]
    return "-" if gap is None else f"{gap:.3g} s"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f}"

"""`simulate` (one scenario, its latency table) and `list` (the registered names)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from sim.cli.common import app, check_seed, console, fmt, pct, refuse_unused, set_option

if TYPE_CHECKING:
    from sim.config.scenario import Scenario


@app.command()
def simulate(
    ctx: typer.Context,
    scenario: Annotated[Path | None, typer.Argument(
        metavar="SCENARIO", help="scenario YAML; omit to run the embedded default scenario")
    ] = None,
    out: Annotated[Path | None, typer.Option(
        help="directory for the result files", show_default="results/<scenario name>")
    ] = None,
    seed: Annotated[int | None, typer.Option(
        min=0, help="the scenario's seed, over the file and --set seed=N")] = None,
    replications: Annotated[int, typer.Option(
        min=1, help="independent replications (seeds SEED+0..N-1), each in OUT/rep<k>/; "
                    "every headline metric with a 95% confidence interval")] = 1,
    workers: Annotated[int | None, typer.Option(
        min=1, help="replications: worker processes", show_default="one per CPU")] = None,
    set_: Annotated[list[str] | None, set_option(
        "over the scenario file, under --seed")] = None,
    as_json: Annotated[bool, typer.Option(
        "--json", help="print the summary (summary.json; replications.json with "
                       "--replications) as JSON on stdout, nothing else there; results "
                       "written as usual")] = False,
) -> None:
    """Run one scenario; print its latency table; write results beside the resolved scenario."""
    from sim.config.overrides import load_scenario, parse_overrides
    from sim.runner import run_scenario
    from sim.studies.progress import ProgressReport

    check_seed(seed)
    if replications == 1:
        source = ctx.get_parameter_source("replications")
        if source is not None and source.name == "COMMANDLINE":
            # Taken as given, it would silently be a plain run.
            from sim.config.errors import COMMAND_LINE, InputError

            raise InputError(COMMAND_LINE, "--replications", 1, "one replication is a plain "
                             "run, without intervals or replications.json: give 2 or more, "
                             "or leave it out")
        refuse_unused(ctx, {"workers": "only with --replications N (N > 1)"})
    loaded = load_scenario(scenario, parse_overrides(set_))
    if seed is not None:
        loaded = loaded.model_copy(update={"seed": seed})
    out_dir = out if out is not None else Path("results") / loaded.name
    shown = Console(stderr=True) if as_json else console  # stdout is the JSON's alone
    if replications > 1:
        simulate_replicated(loaded, replications, out_dir, workers, shown, as_json)
        return
    with interrupt_exits(out_dir, "the run was", "results are", shown), \
            ProgressReport(f"simulating {loaded.name}", "arrivals") as progress:
        results = run_scenario(loaded, out_dir=out_dir,
                               on_progress=lambda done, total: progress.update(done, total))
    try:
        show_run(results.summary, out_dir, shown, as_json)
    except KeyboardInterrupt:  # the results are written: say so, not only "interrupted"
        shown.print(f"interrupted after the run was complete: its results are in {out_dir}/ "
                    "whole")
        raise typer.Exit(130) from None


def show_run(summary: dict[str, Any], out_dir: Path, shown: Console, as_json: bool) -> None:
    """A finished run's tables (or its summary as JSON) and what to know about it."""
    if as_json:
        print(json.dumps(summary, indent=2, sort_keys=True))
    else:
        console.print(summary_table(summary))
        if len(summary["replicas"]) > 1:
            console.print(replica_table(summary))
        if summary.get("classes"):
            console.print(class_table(summary))
    shown.print(overload_line(summary["overload"]))
    if line := rejected_line(summary):
        shown.print(line)
    if why := summary["requests"].get("stalled"):
        num = summary["requests"]["reasons"].get("engine_stalled", 0)
        shown.print(f"[bold red]STALLED[/]: {num:,} requests will never finish: "
                    f"{why.partition(': ')[2]}")
    for line in (sessions_line(summary), speculative_line(summary), offload_line(summary)):
        if line:
            shown.print(line)
    if clients := summary["run"].get("clients"):
        paced = ("each request also waits for its time in the workload" if clients["paced"]
                 else "the workload's arrival times and rate are not used")
        sending = ""
        if clients.get("duration_s") is not None:
            unsent = summary["requests"]["reasons"].get("after_duration", 0)
            sending = f"; sending for {clients['duration_s']:g} s ({unsent:,} never sent)"
        shown.print(f"closed loop: {clients['concurrency']:,} clients, think time "
                    f"{clients['think_time_s']:g} s ({clients['think_time']}); {paced}"
                    f"{sending}")
    if note := summary["run"].get("priorities_ignored"):
        shown.print(f"[yellow]priorities ignored[/]: {note}")
    if note := summary["run"].get("prefix_caching_left_off"):
        shown.print(f"[yellow]prefix caching[/]: {note}")
    for pool, note in summary["run"].get("blocks_beyond_memory", {}).items():
        shown.print(f"[yellow]idealised KV cache[/] ({pool}): {note}")
    if note := summary["run"].get("latency_device_note"):
        shown.print(f"[yellow]other device[/]: {note}")
    if line := calibration_line(summary):
        shown.print(line)
    shown.print(f"results: {out_dir}/ ("
                f"{', '.join(sorted(p.name for p in Path(out_dir).iterdir()))})")


def simulate_replicated(loaded: Scenario, replications: int, out_dir: Path,
                        workers: int | None, shown: Console, as_json: bool) -> None:
    """`simulate --replications N`: N seeds in worker processes; the table of estimates."""
    import os

    from sim.studies.progress import ProgressReport
    from sim.studies.replications import (
        RESULT_FILE,
        check_replicable,
        check_replications_dir,
        replications_table,
        run_replications,
    )

    check_replicable(loaded, replications)
    check_replications_dir(out_dir)
    with interrupt_exits(out_dir, "the replications were", "replications are", shown), \
            ProgressReport(f"simulating {loaded.name}", "replications",
                           total=replications) as progress:
        finished: list[int] = []

        def done(k: int, summary: dict[str, Any]) -> None:
            finished.append(k)
            progress.update(len(finished))
            progress.note(f"rep{k} (seed {loaded.seed + k}): "
                          f"{summary['overload']['verdict']}")

        data = run_replications(loaded, replications, out_dir, workers=min(
            workers or os.cpu_count() or 1, replications), on_done=done)
    if as_json:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        console.print(replications_table(data))
    shown.print(f"results: {out_dir}/{RESULT_FILE}, {out_dir}/rep<k>/ (one run each)",
                soft_wrap=True)


@contextlib.contextmanager
def interrupt_exits(out_dir: Path, done: str, written: str,
                    shown: Console = console) -> Iterator[None]:
    """Ctrl-C exits 130 with what is on disk: the new results whole if the swap had begun
    (`done`: "the run was"), else the previous ones or nothing (`written`: "results are")."""
    from sim.results.outdir import SwappedInterrupt, is_earlier_results

    try:
        yield
    except SwappedInterrupt:
        shown.print(f"interrupted after {done} complete: the new results are in {out_dir}/ "
                      "whole")
        raise typer.Exit(130) from None
    except KeyboardInterrupt:
        kept = "the previous results are" if is_earlier_results(out_dir) else "nothing was"
        shown.print(f"interrupted: {kept} kept in {out_dir}/ ({written} written whole or "
                      "not at all)")
        raise typer.Exit(130) from None


def rejected_line(summary: dict[str, Any]) -> str | None:
    """Loud where requests were rejected (they can never be served here), with every reason
    kind counted; None where none were."""
    req = summary["requests"]
    if not req["rejected"]:
        return None
    reasons = ", ".join(f"{kind} {n:,}" for kind, n in req["rejected_reasons"].items())
    return (f"[bold yellow]REJECTED[/]: {req['rejected']:,} of {req['total']:,} requests can "
            f"never be served by this replica (reasons: {reasons})")


def sessions_line(summary: dict[str, Any]) -> str | None:
    """Sessions (multi-turn conversations): how many completed, how long they took, and how
    TTFT and the prefix cache's hit rate went from the first turn to the later ones."""
    sessions = summary.get("sessions")
    if not sessions:
        return None
    line = (f"sessions: {sessions['num_completed']:,} of {sessions['num_sessions']:,} "
            "completed")
    if (p50 := sessions["duration_s"]["p50"]) is not None:
        line += f", duration P50 {p50:.3g} s"
    turns = sessions["by_turn"]
    first, later = turns[0], turns[1:]
    if later and first["ttft_s"]["p50"] is not None and later[0]["ttft_s"]["p50"] is not None:
        hits = [f"{100 * t['hit_rate_tokens']:.0f}%" if t["hit_rate_tokens"] is not None
                else "-" for t in turns[:4]]
        line += (f"; TTFT P50 turn 0 {1e3 * first['ttft_s']['p50']:.3g} ms, turn 1 "
                 f"{1e3 * later[0]['ttft_s']['p50']:.3g} ms; prefix hits by turn "
                 f"{', '.join(hits)}{', ...' if len(turns) > 4 else ''}")
    return line


def speculative_line(summary: dict[str, Any]) -> str | None:
    """Speculative decoding as vLLM's benchmark reports it: acceptance rate and length."""
    spec = summary.get("speculative")
    if not spec or spec["acceptance_length"] is None:
        return None
    per_pos = "/".join(f"{r:.2f}" for r in spec["per_position_acceptance_rates"])
    if spec.get("engine") == "sglang":
        # SGLang's log line: "accept len" (tokens a verify yields) and "accept rate" (drafts
        # accepted of those verified); depths past the draft tree's are never accepted.
        depth = spec["num_steps"] if spec["algorithm"] != "ngram" else len(
            spec["per_position_acceptance_rates"])
        per_depth = "/".join(f"{r:.2f}" for r in spec["per_position_acceptance_rates"][:depth])
        return (f"speculative decoding (SGLang {spec['algorithm']}, {spec['num_steps']} steps x "
                f"{spec['eagle_topk']} branches, {spec['num_draft_tokens']} tokens verified): "
                f"accept len {spec['acceptance_length']:.2f} (drawn: "
                f"{spec['expected_acceptance_length']:.2f}), accept rate "
                f"{spec['acceptance_rate'] / 100:.2f}; by depth {per_depth}")
    return (f"speculative decoding (k={spec['num_speculative_tokens']}): acceptance rate "
            f"{spec['acceptance_rate']:.1f}%, length {spec['acceptance_length']:.2f} tokens "
            f"per step (drawn: {spec['expected_acceptance_length']:.2f}); by position "
            f"{per_pos}")


def offload_line(summary: dict[str, Any]) -> str | None:
    """The KV cache's CPU tier: hits per tier, and the copies' time."""
    off = summary.get("kv_offload")
    if not off:
        return None
    hits = off["hit_rate_tokens"]
    if hits["cpu"] is None:
        return None
    mean = off["mean_load_s"]
    line = (f"KV CPU tier ({', '.join(f'{n:,}' for n in off['num_cpu_blocks'])} blocks): prompt "
            f"tokens hit on GPU {100 * hits['gpu']:.1f}%, loaded from CPU {100 * hits['cpu']:.1f}% "
            f"({off['num_loads']:,} loads" + (f", {1e3 * mean:.3g} ms each" if mean else "")
            + f"); {off['num_stored_blocks']:,} blocks stored, {off['num_evicted_blocks']:,} "
            "evicted")
    decode = off.get("pools", {}).get("decode")
    if decode:  # (a disaggregated cluster's decode pool keeps a tier of its own)
        line += (f"; of those, on the decode pool: {decode['num_stored_blocks']:,} stored, "
                 f"{decode['num_evicted_blocks']:,} evicted, {decode['num_loads']:,} reloads "
                 f"after preemption, stores busy {decode['store_busy_s']:.3g} s")
    return line


def overload_line(verdict: dict[str, Any]) -> str:
    """The run's overload verdict, loud when it is overloaded."""
    if verdict["verdict"] == "overloaded":
        return (f"[bold red]OVERLOADED[/]: {verdict['detail']}; latencies grow with the "
                "trace's length and do not describe a steady state")
    return f"{verdict['verdict']}: {verdict['detail']}"


def calibration_line(summary: dict[str, Any]) -> str | None:
    """Which engine calibration timed the run, and how far it is from measured runs."""
    from sim.config.engine import calibration_text

    cal = summary.get("latency_model", {}).get("calibration")
    return calibration_text(cal) if cal else None


LATENCY_ROWS = (  # summary key, label, scale to the unit in the label
    ("ttft_s", "TTFT ms", 1e3),
    ("client_ttft_s", "TTFT ms, client", 1e3),
    ("tbt_s", "TBT ms (all gaps)", 1e3),
    ("max_tbt_per_request_s", "worst TBT/req ms", 1e3),
    ("tpot_s", "TPOT ms", 1e3),
    ("e2e_s", "E2E s", 1.0),
    ("client_e2e_s", "E2E s, client", 1.0),
    ("scheduling_delay_s", "sched. delay ms", 1e3),
)


def summary_table(summary: dict[str, Any]) -> Table:
    """Latency percentiles, then outcomes, throughput and SLO attainment; TTFT over finished
    requests and, where some arrived but did not finish, over every arrival; in the caption,
    whether a warm-up was trimmed."""

    def warmup_line() -> str | None:
        """Whether the run's start-up transient was trimmed (`summary["warmup"]`)."""
        warmup, trimmed = summary.get("warmup"), summary.get("trimmed")
        if not warmup:
            return None
        if not warmup["applies"]:
            return "warm-up: none assumed (replayed trace); nothing trimmed"
        head = f"warm-up ({warmup['method']}): "
        fixed = warmup["method"] == "clients.warmup_requests"
        if warmup["steady_state"] is None and not fixed:
            return head + f"not checked ({warmup['reason']})"
        if warmup["steady_state"] is False and not fixed:
            why = ("overloaded" if warmup["reason"].startswith("overloaded") else
                   f"truncation at request {warmup['mser_truncation_requests']:,} of "
                   f"{warmup['num_requests']:,}: run longer")
            return head + f"no steady state ({why}); nothing trimmed"
        cut = warmup["num_trimmed_requests"]
        if fixed and not trimmed:
            if cut < warmup["num_requests"]:
                return head + (f"first {cut:,} of {warmup['num_requests']:,} requests sent "
                               "trimmed; none after them was admitted (rejected)")
            return head + f"all {warmup['num_requests']:,} requests sent were warm-up"
        if not cut or not trimmed:
            return head + "none found; nothing trimmed"
        ttft = trimmed["ttft_s"]
        return (head + f"first {cut:,} of {warmup['num_requests']:,} requests trimmed "
                f"(arrivals before {warmup['trimmed_until_s']:,.4g} s); after them TTFT "
                f"P50/P99 {fmt(ttft['p50'], 1e3)}/{fmt(ttft['p99'], 1e3)} ms")

    def at_least(value: float | None, scale: float) -> str:
        """">=" and the value, in as many digits as fit the width of `fmt`'s (9)."""
        if value is None:
            return "-"
        x = value * scale
        shown = [fmt(value, scale), f"{x:,.0f}", f"{x:.3g}", f"{x:.2g}"]
        return ">=" + next((t for t in shown if len(t) <= 7), f"{x:.0e}")

    run = summary["run"]
    split = run.get("parallelism", "TP1")
    on = run["gpu"] if split == "TP1" else f"{split} {run['gpu']}"
    # No padding at the table's edges: a 17-character label, five 9-character numbers (fmt's
    # widest) and "unfinished" fit 80 columns.
    # Two lines, what runs and how: rich wraps a title at the table's width, wherever a space
    # falls ("..., seed" / "0" on an 80-column terminal).
    model = f"{run['model']} ({run['precision']})" if run.get("precision") else run["model"]
    table = Table(title=f"{run['scenario']}: {model} on {on}\n{run['scheduler']}, "
                        f"{run['latency']} latency, seed {run['seed']}", pad_edge=False)
    table.add_column("metric", no_wrap=True)
    for col in ("P50", "P90", "P99", "max", "mean"):
        table.add_column(col, justify="right", no_wrap=True)
    stats = ("p50", "p90", "p99", "max", "mean")
    arrived = summary.get("ttft_all_arrived_s")
    for key, label, scale in LATENCY_ROWS:
        dist = summary.get(key)
        if dist is None:  # client-side rows: not in results made before they existed
            continue
        if key == "ttft_s" and "population" in dist and "client_ttft_s" not in summary:
            label = f"{label}, {dist['population']}"  # results from before client-side rows
        elif key in ("ttft_s", "e2e_s") and "client_ttft_s" in summary:
            label = f"{label}, engine"
        table.add_row(label, *(fmt(dist[k], scale) for k in stats))
        if key == "ttft_s" and arrived and arrived["count"] != dist["count"]:
            # Every arrived request, one not served by the end at its wait so far: ">=" marks
            # a lower bound (the true figure is at least that).
            bound = arrived.get("is_lower_bound", {})
            table.add_row("TTFT ms, arrived", *(
                at_least(arrived[k], scale) if bound.get(k) else fmt(arrived[k], scale)
                for k in stats))
    lines = [warmup_line()]
    transfer = summary.get("transfer")
    if (transfer and "tbt_attainment" in summary.get("slo", {})
            and transfer.get("first_token_from") != "decode"):
        # A request's worst gap is often its hand-off: first token on a prefill replica, the
        # second once its KV reached a decode replica.
        wait, move = transfer["decode_wait_s"]["p50"], transfer["transfer_s"]["p50"]
        lines.append("disaggregated: a request's worst TBT gap includes its KV hand-off "
                     f"(P50 wait for a decode slot {fmt(wait, 1e3)} ms, transfer "
                     f"{fmt(move, 1e3)} ms); 'SLO met: TBT, gaps' counts every gap")
    if arrived and arrived["count"] != summary["ttft_s"]["count"]:
        lines.append("latency rows: finished requests; 'arrived': every request that arrived")
    table.caption = "\n".join(line for line in lines if line) or None
    table.caption_justify = "left"
    req, thr = summary["requests"], summary["throughput"]
    table.add_section()
    table.add_row("requests", str(req["total"]), "finished", str(req["finished"]), "", "")
    table.add_row("", "", "rejected", str(req["rejected"]), "", "")
    if req.get("failed"):  # clients that gave up (`workload.timeout_s`)
        table.add_row("", "", "failed", str(req["failed"]), "timed out", "")
    table.add_row("", "", "unfinished", str(req["unfinished"]), "", "")
    table.add_row("throughput", fmt(thr["requests_per_s"]), "req/s",
                  fmt(thr["output_tokens_per_s"]), "out tok/s", "")
    cost = summary.get("cost")
    if cost:
        table.add_row(f"per GPU ({cost['num_gpus']})", fmt(cost["requests_per_s_per_gpu"]),
                      "req/s", fmt(cost["output_tokens_per_s_per_gpu"]), "out tok/s", "")
        if cost["usd_per_million_tokens"] is not None:
            table.add_row("cost $/M tokens", fmt(cost["usd_per_million_tokens"]), "all",
                          fmt(cost["usd_per_million_output_tokens"]), "output", "")
    # Which SLO, and of what: requests (a request meets the TBT target when its worst gap
    # does), or every TBT gap of the run (`sim.results.metrics.summary.slo_attainment`).
    for name, value in summary["slo"].items():
        label, of = SLO_ROWS.get(name, (name, ""))
        table.add_row(label, pct(value), of, "", "", "")
    return table


SLO_ROWS = {"ttft_attainment": ("SLO met: TTFT", "requests"),
            "tbt_attainment": ("SLO met: TBT", "requests"),
            "tbt_gap_attainment": ("SLO met: TBT", "gaps"),
            "all_attainment": ("SLO met: all", "requests")}


def replica_table(summary: dict[str, Any]) -> Table:
    """Per replica: pool, iterations, busy fraction, queue and KV use; then transfers."""
    table = Table(title="replicas")
    for col in ("id", "pool", "iterations", "busy", "mean queue", "max queue", "mean KV",
                "max KV"):
        table.add_column(col, justify="right", no_wrap=col in ("pool", "iterations"))
    for r in summary["replicas"]:
        table.add_row(str(r["replica_id"]), str(r["pool"]), f"{r['num_iterations']:,}",
                      pct(r["busy_fraction"]), fmt(r["mean_queue_length"]),
                      str(r["max_queue_length"]), pct(r["mean_kv_utilization"]),
                      pct(r["max_kv_utilization"]))
    transfer = summary.get("transfer")
    if transfer:
        wait, move = transfer["decode_wait_s"], transfer["transfer_s"]
        table.caption = (f"KV transfer P50/P99: {fmt(move['p50'], 1e3)}/{fmt(move['p99'], 1e3)}"
                         f" ms; waiting for decode KV P50/P99: {fmt(wait['p50'], 1e3)}/"
                         f"{fmt(wait['p99'], 1e3)} ms")
    return table


def class_table(summary: dict[str, Any]) -> Table:
    """Per request class: priority, requests, TTFT and E2E of its finished requests, its TBT
    gaps, and SLO attainment against its own targets."""
    from rich import box

    names = [c["name"] for c in summary["classes"]]
    # No vertical rules: the names get the room (80 columns), folding past 16 characters.
    table = Table(title="request classes", caption="TTFT and TBT in ms, E2E in s; SLO "
                  "met: the class's own targets, else the run's", box=box.SIMPLE_HEAD,
                  show_edge=False, pad_edge=False)
    for col in ("class", "prio", "finished", "TTFT\nP50", "TTFT\nP99", "TBT\nP99", "E2E\nP50",
                "SLO\nmet"):  # (80 columns: the headers on two lines)
        # A long class name folds; the numbers stay whole (80 columns).
        table.add_column(col, justify="left" if col == "class" else "right",
                         no_wrap=col != "class", overflow="fold" if col == "class" else "ellipsis",
                         max_width=16 if col == "class" else None,
                         min_width=min(16, max(map(len, names))) if col == "class" else None)
    for c in summary["classes"]:
        req = c["requests"]
        table.add_row(c["name"], str(c["priority"]), f"{req['finished']:,}/{req['total']:,}",
                      fmt(c["ttft_s"]["p50"], 1e3), fmt(c["ttft_s"]["p99"], 1e3),
                      fmt(c["tbt_s"]["p99"], 1e3), fmt(c["e2e_s"]["p50"]),
                      pct(c["slo"].get("all_attainment")))
    return table

"""What every command group shares: the typer app, the console and number formatting."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import typer
from rich.console import Console

from sim.results.labels import fmt, pct  # noqa: F401  (the commands' number formats)


class _Typer(typer.Typer):
    """typer (0.28, 0.29) prints a command's docstring with its line breaks kept after the first
    paragraph, and in the command list within the first too, so text broken at 100 columns in
    the source is broken twice on a terminal: each paragraph is made one line here, for the
    terminal's width to wrap."""

    def command(self, *args: Any, **kwargs: Any) -> Callable[[Callable[..., Any]], Any]:
        def register(func: Callable[..., Any]) -> Any:
            if kwargs.get("help") is None and func.__doc__:
                paragraphs = inspect.cleandoc(func.__doc__).split("\n\n")
                kwargs["help"] = "\n\n".join(" ".join(p.split()) for p in paragraphs)
            return super(_Typer, self).command(*args, **kwargs)(func)

        return register


app = _Typer(add_completion=False, no_args_is_help=True,
             help="Simulate LLM serving: TTFT and inter-token latency, before GPU hours.")
console = Console()

SET_HELP = ("change a scenario field before it is checked, VALUE read as YAML, e.g. "
            "--set replica.gpu=h200; repeatable, the last one wins")


def set_option(precedence: str) -> Any:
    """The `--set PATH=VALUE` option of a command that reads scenarios, its help ending with
    what it takes precedence over (and under)."""
    return typer.Option("--set", metavar="PATH=VALUE", help=f"{SET_HELP}; {precedence}")


def check_seed(seed: int | None) -> None:
    """`--seed` at most MAX_SEED: it replaces the scenario's with `model_copy`, which does not
    validate (the scenario's own field is bounded)."""
    from sim.config.errors import COMMAND_LINE, InputError
    from sim.config.scenario import MAX_SEED  # here: `servesim --help` starts without pydantic

    if seed is not None and seed > MAX_SEED:
        raise InputError(COMMAND_LINE, "--seed", seed, f"at most {MAX_SEED} (2**63 - 1)")


def wide_console(min_width: int = 150) -> Console:
    """A console at least `min_width` wide, for tables with many columns."""
    return Console(width=max(console.width, min_width))


def interrupted(kept: str) -> typer.Exit:
    """Say what an interrupted command kept; the exit to raise (130, as after SIGINT)."""
    print(f"interrupted: {kept}", file=sys.stderr, flush=True)
    return typer.Exit(130)


def refuse_unused(ctx: typer.Context, unused: dict[str, str]) -> None:
    """Options given on the command line that this invocation would ignore are refused, not
    dropped: `unused` maps each such parameter's name to when it applies (a default left
    alone is fine)."""
    from sim.config.errors import COMMAND_LINE, InputError

    for name, applies in unused.items():
        source = ctx.get_parameter_source(name)
        if source is not None and source.name == "COMMANDLINE":
            option = "--" + name.rstrip("_").replace("_", "-")
            raise InputError(COMMAND_LINE, option, ctx.params[name],
                             f"{applies}: here it would be ignored")


def calibration_lines(scenarios: Any) -> list[str]:
    """One line per engine calibration the scenarios' replicas use: its name, what it was
    measured on and how far runs made with it are from the measurements."""
    from sim.config.engine import band_facts, calibration_text

    seen: dict[str, dict[str, Any]] = {}
    for scenario in scenarios:
        for pool in scenario.pools():
            cal = pool.replica.calibration
            facts = seen.setdefault(cal.name, {**cal.model_dump(), "bands": {}})
            gpu = pool.replica.measured_gpu
            facts["bands"].setdefault(gpu, band_facts(cal, gpu))
    # (bands keyed by GPU: several scenarios, one line per calibration)
    return [calibration_text(facts) for facts in seen.values()]

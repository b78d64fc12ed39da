"""`servesim list`: what can be named in a scenario (schedulers, latency models, trace formats,
routers, models, GPUs, engine calibrations), the GPUs', models' and calibrations' figures, and
with `--params` every parameter with its default and unit."""

from __future__ import annotations

import typing
from typing import Annotated, Any

import typer
from rich.console import Group
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from sim.cli.common import app, console

# The registries of code (kind, package, the registry's name in its modules), as `list` shows them.
REGISTRIES = (("scheduler", "sim.schedulers", "SCHEDULERS"),
              ("latency model", "sim.latency", "LATENCY_MODELS"),
              ("workload format", "sim.workloads", "FORMATS"),
              ("router", "sim.routers", "ROUTERS"))


@app.command("list")
def list_registered(
    params: Annotated[bool, typer.Option(
        "--params", help="also each scheduler's, latency model's and router's parameters: "
                         "default with its unit, meaning and allowed values")] = False,
) -> None:
    """List the registered schedulers, latency models, formats, routers, models and GPUs.

    Then each GPU's and model's figures; with --params, each scheduler's, latency model's and
    router's parameters."""
    # The policies' names as their modules' decorators give them, read without importing the
    # modules (nor numpy): listing stays quick. Nothing builds a scenario model to list names.
    from sim.config.engine import AUTO, NONE, read_calibration, shipped_names
    from sim.core.registry import registered_names
    from sim.hardware.gpus import GPUS
    from sim.hardware.models import MODELS

    table = Table(title="registered names")
    table.add_column("kind")
    table.add_column("names")
    for kind, package, attribute in REGISTRIES:
        table.add_row(kind, ", ".join(sorted(registered_names(package, attribute))))
    for registry in (MODELS, GPUS):
        table.add_row(registry.kind, ", ".join(registry.names()))
    names = shipped_names()
    table.add_row("engine calibration", ", ".join([AUTO, NONE, *names]))
    console.print(table)
    for line in calibration_paragraphs([read_calibration(name)[0] for name in names]):
        console.print(line)
    console.print(gpu_table([GPUS.get(name) for name in GPUS]))
    console.print(model_table([MODELS.get(name) for name in MODELS]))
    if not params:
        console.print("their parameters, defaults and units: servesim list --params")
        return
    from sim.config.clients import ClientsConfig
    from sim.latency import LATENCY_MODELS
    from sim.latency.base import LatencyConfig
    from sim.routers import ROUTERS
    from sim.routers.base import RouterConfig
    from sim.schedulers import SCHEDULERS
    from sim.schedulers.base import SchedulerConfig
    from sim.workloads import FORMATS
    from sim.workloads.base import WorkloadConfig

    for shown in params_tables([("scheduler", SCHEDULERS, SchedulerConfig),
                                ("latency model", LATENCY_MODELS, LatencyConfig),
                                ("router", ROUTERS, RouterConfig),
                                ("workload format", FORMATS, WorkloadConfig)]):
        console.print(shown)
    console.print(params_table("clients (closed loop)", parameter_rows(ClientsConfig)))
    from sim.config.replica import KVOffloadConfig

    console.print(params_table("replica.kv_offload (a CPU tier for the KV cache: vllm_v1 "
                               "0.15.1 or 0.33.0 with prefix caching; a colocated replica, "
                               "a prefill or a decode pool; data-parallel ranks, synchronous)",
                               parameter_rows(KVOffloadConfig)))
    from sim.hardware.parallelism import Parallelism

    console.print(params_table("replica.parallelism (GPUs: tensor x pipeline x data)",
                               parameter_rows(Parallelism)))


def calibration_paragraphs(calibrations: list[Any]) -> list[str]:
    """Each shipped engine calibration, a paragraph: what it was measured on, its fitted
    figures, and how far runs made with it are from the measurements (too long for a table's
    cells in 80 columns)."""
    lines = ["[bold]engine calibrations[/] (replica.engine; auto: vLLM's but for sglang)"]
    for c in calibrations:
        front = f"{c.frontend_s * 1e3:.3g} ms" + (
            f" + {c.frontend_per_extra_gpu_s * 1e3:.3g} ms per GPU beyond the first"
            if c.frontend_per_extra_gpu_s else "")
        fitted = ", ".join(f"{k} {v}" for k, v in c.latency.items())
        lines.append(f"[bold]{c.name}[/] ({c.engine}{', ' + c.gpu if c.gpu else ''}): front "
                     f"end {front}; roofline {fitted or 'defaults'}. {c.error}")
    return lines


def gpu_table(gpus: list[Any]) -> Table:
    """Each GPU's datasheet figures and price (their sources and dates are in
    sim/hardware/gpus.py)."""
    table = Table(title="GPUs", caption_justify="left",
                  caption="TFLOP/s: dense, no sparsity (fp8 -: no fp8 math); link: per GPU, "
                          "one direction, over "
                          "the tensor-parallel fabric; $: on-demand list price per GPU-hour "
                          "(sources and dates: sim/hardware/gpus.py)")
    table.add_column("gpu", no_wrap=True)
    for col in ("TFLOP/s\nbf16", "\nfp8", "mem\nGB/s", "\nGiB", "link\nGB/s"):
        table.add_column(col, justify="right")
    table.add_column("fabric", no_wrap=True)
    table.add_column("$/GPU\n-hour", justify="right")
    for g in gpus:
        cost = getattr(g, "cost_per_gpu_hour", None)
        link = getattr(g, "interconnect_bandwidth_bytes_s", None)
        fp8 = getattr(g, "peak_fp8_flops", None)
        table.add_row(g.name, f"{g.peak_bf16_flops / 1e12:,.0f}",
                      "-" if fp8 is None else f"{fp8 / 1e12:,.0f}",
                      f"{g.memory_bandwidth_bytes_s / 1e9:,.0f}", f"{g.memory_bytes / 2**30:,.0f}",
                      "-" if link is None else f"{link / 1e9:,.0f}",
                      getattr(g, "interconnect", "-"), "-" if cost is None else f"{cost:.2f}")
    return table


def model_table(models: list[Any]) -> Table:
    """Each model's size and shape: parameters (total and active per token), layers, KV bytes
    per token, context window, experts."""
    table = Table(title="models", caption_justify="left",
                  caption="params: billions, total / active per token where they differ; KV: "
                          "K and V of every layer for one token; experts: routed / per token")
    table.add_column("model", no_wrap=True)
    for col in ("params\nbillions", "layers", "KV KiB\nper token", "context\ntokens",
                "experts"):
        table.add_column(col, justify="right")
    for m in models:
        total = m.num_params
        active = getattr(m, "num_active_params", total)
        num_experts = getattr(m, "num_experts", 0) or 0
        per_token = getattr(m, "num_experts_per_token", 0) or 0
        size = (f"{total / 1e9:.3g}" if active == total
                else f"{total / 1e9:.3g} / {active / 1e9:.3g}")
        table.add_row(m.name, size, str(m.num_layers), f"{m.kv_bytes_per_token / 1024:,.4g}",
                      "-" if m.max_model_len is None else f"{m.max_model_len:,}",
                      f"{num_experts} / {per_token}" if num_experts else "-")
    return table


def params_tables(groups: list[tuple[str, Any, Any]]) -> list[Table | str]:
    """For each (kind, registry, base config class): the parameters every entry shares, then each
    entry's own (new, or with another default or meaning), from the pydantic Configs: default
    (with the unit its name's suffix gives), description, allowed values."""
    shown: list[Table | str] = []
    for kind, registry, base in groups:
        common = parameter_rows(base)
        if common:
            shown.append(params_table(f"every {kind}", common))
        bare = []
        for name in registry.names():
            own = {k: row for k, row in parameter_rows(registry.get(name).Config).items()
                   if common.get(k) != row}
            if own:
                shown.append(params_table(f"{kind} {name}", own))
            else:
                bare.append(name)
        if bare:
            shown.append(f"{kind}s with no parameters of their own: {', '.join(bare)}")
    return shown


# The narrowest meaning column a parameters table is drawn with; in a narrower terminal each
# parameter's meaning goes beneath it (at 80 columns a scheduler's long names and defaults left
# the meaning 12 columns, a word or two a line).
MIN_MEANING_COLUMNS = 40


def params_table(title: str, rows: dict[str, tuple[str, str]]) -> Table:
    """parameter | default | meaning, the meaning wrapping; where the terminal leaves the
    meaning fewer than MIN_MEANING_COLUMNS, one column: each parameter and its default on a
    line, its meaning indented beneath, the terminal's whole width."""
    table = Table(title=title, title_justify="left")
    widest_key = max((len(key) for key in rows), default=0)
    widest_default = max((len(default) for default, _ in rows.values()), default=0)
    # (Three columns' borders and padding: 10 characters.)
    if console.width - widest_key - widest_default - 10 >= MIN_MEANING_COLUMNS:
        table.add_column("parameter", no_wrap=True)
        table.add_column("default", no_wrap=True)
        table.add_column("meaning", overflow="fold")  # (a long flag's name folds, not cut)
        for key, (default, meaning) in rows.items():
            table.add_row(key, default, meaning)
        return table
    table.add_column("parameter = default, then its meaning", overflow="fold")
    for key, (default, meaning) in rows.items():
        table.add_row(Group(Text.assemble((key, "bold"), " = ", default),
                            Padding(Text(meaning, overflow="fold"), (0, 0, 0, 4))))
    return table


UNIT_SUFFIXES = (("_gb_s", "GB/s"), ("_ms", "ms"), ("_s", "s"), ("_gb", "GB"),
                 ("_bytes", "bytes"), ("_tokens", "tokens"))


def parameter_rows(config: Any, prefix: str = "") -> dict[str, tuple[str, str]]:
    """A config class's parameters (nested models flattened, `noise.sigma`), each as (default,
    meaning); the registry key (`name`, `kind`) left out."""
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    rows: dict[str, tuple[str, str]] = {}
    for key, info in config.model_fields.items():
        if key in ("name", "kind") and not prefix:
            continue
        nested = info.annotation
        # `X | None` of a section: its fields, under a row saying it is optional.
        options = [a for a in typing.get_args(nested) if a is not type(None)]
        optional = len(options) == 1 and len(typing.get_args(nested)) == 2
        if optional:
            nested = options[0]
        # A list of sections (`classes`): each item's fields, as `classes[].name`.
        items = typing.get_args(nested) if typing.get_origin(nested) is list else ()
        if len(items) == 1 and isinstance(items[0], type) and issubclass(items[0], BaseModel):
            rows[prefix + key] = ("None" if optional else "[]", "; ".join(part for part in (
                (info.description or "").rstrip("."), "a list: each item has the fields "
                                                      "below") if part))
            rows.update(parameter_rows(items[0], f"{prefix}{key}[]."))
            continue
        if isinstance(nested, type) and issubclass(nested, BaseModel):
            if optional:
                rows[prefix + key] = ("None", "; ".join(part for part in (
                    (info.description or "").rstrip("."), "optional: the fields below, "
                                                          "when given") if part))
            rows.update(parameter_rows(nested, f"{prefix}{key}."))
            continue
        default = info.get_default(call_default_factory=True)
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        unit = str(extra.get("unit") or next(
            (u for suffix, u in UNIT_SUFFIXES if key.endswith(suffix)), ""))
        shown = ("(required)" if default is PydanticUndefined
                 else f"{default:g}" if isinstance(default, float) else str(default))
        if unit and isinstance(default, int | float) and not isinstance(default, bool):
            shown += f" {singular(unit) if default == 1 else unit}"
        if "shown_default" in extra:  # a default resolved from the deployment, said so
            shown = str(extra["shown_default"])
        meaning = "; ".join(part for part in ((info.description or "").rstrip("."),
                                              allowed(info)) if part)
        rows[prefix + key] = (shown, meaning)
    return rows


def singular(unit: str) -> str:
    """A counted unit for one: "request" for "requests"; symbols ("s", "ms", "GB/s") as they
    are."""
    return unit[:-1] if unit.isalpha() and len(unit) > 2 and unit.endswith("s") else unit


def allowed(info: Any) -> str:
    """The values a field takes, from its type and bounds: `one of: a, b`, `0<x<=1` (no
    spaces: a table wraps its cells at spaces)."""
    import typing

    choices = [c for arg in (info.annotation, *typing.get_args(info.annotation))
               if typing.get_origin(arg) is typing.Literal for c in typing.get_args(arg)]
    if choices:
        return "one of: " + ", ".join(map(str, choices))
    bounds = {attr: value for bound in info.metadata for attr in ("gt", "ge", "lt", "le")
              if (value := getattr(bound, attr, None)) is not None}
    if not bounds:
        return ""
    parts = [f"{v:g}" if isinstance(v, float) else str(v) for v in bounds.values()]
    ops = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    if len(bounds) == 1:
        (attr,) = bounds
        return f"x{ops[attr]}{parts[0]}"
    low, high = parts[0], parts[1]
    (lo, hi) = bounds
    return f"{low}{ops[lo].replace('>', '<')}x{ops[hi]}{high}"

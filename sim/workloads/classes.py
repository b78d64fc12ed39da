"""Request classes (`workload.classes`): each request belongs to one class, drawn by the
classes' shares, which gives it its request `priority` (vLLM serves lower values first under
`scheduling_policy: priority`; SGLang higher ones under `enable_priority_scheduling`) and,
optionally, SLOs of its own. The run reports every
metric per class (`summary.classes`, the `request_class` column)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import BaseModel, Field

from sim.config.errors import INPUT_MODEL, invalid
from sim.config.slo import SLOConfig

if TYPE_CHECKING:
    from sim.workloads.base import Sessions

# vLLM's `priority` is a Python int; engines store it as a 64-bit one at most.
MAX_PRIORITY = 2**31 - 1
# Classes are drawn from their own stream of the scenario's seed: adding classes changes no
# other draw (arrivals, lengths), so a run with and without them serves the same requests.
CLASS_STREAM = 0x636C6173  # "clas"


class RequestClassConfig(BaseModel):
    model_config = INPUT_MODEL

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.+-]+$",
                      description="how the results name the class")
    share: float | None = Field(None, gt=0, le=1,
                                description="share of the requests in it (shares sum to 1); "
                                            "none where the trace tags each request's class "
                                            "(columns.request_class)")
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY,
                          description="the request priority: vLLM serves lower values first "
                                      "(vllm_v1, scheduling_policy: priority), SGLang higher "
                                      "ones (sglang, enable_priority_scheduling)")
    slo: SLOConfig | None = Field(None, description="targets of its own (ttft_s, tbt_s); none: "
                                                    "the scenario's slo")


def check_classes(value: list[RequestClassConfig] | None, column: str | None) -> None:
    """Distinct names; shares summing to 1, or none where a trace's `column` tags each
    request's class (`columns.request_class`, which needs the classes listed)."""
    if value is None:
        if column is not None:
            raise invalid(("columns.request_class", column, "names classes: list them "
                           "(workload.classes: name, priority, slo)"))
        return
    names = [c.name for c in value]
    given = [c.share for c in value if c.share is not None]
    total = sum(given)
    if len(set(names)) != len(names):
        why = f"class names must differ: {', '.join(names)}"
    elif column is not None:
        why = ("the trace tags each request's class (columns.request_class): leave the "
               "shares out") if given else ""
    elif len(given) < len(value):
        why = ("each class needs its share (or a trace column naming each request's class: "
               "columns.request_class)")
    else:
        why = f"shares sum to {total:g}: they must sum to 1" if abs(total - 1) > 1e-6 else ""
    if why:
        raise invalid(("classes", names, why))


CLASSES_FIELD: Any = Field(
    None, min_length=1, max_length=100,
    description="request classes, each {name, share, priority, slo}: every request is drawn "
                "into one by the shares (a session's turns into its first turn's), or tagged "
                "by the trace (csv, jsonl: columns.request_class); metrics per class; none: "
                "one class")


def tagged_classes(names: list[str], classes: list[RequestClassConfig],
                   problem: Any) -> np.ndarray:
    """Each request's class index from the class names a trace tags them with; `problem(row,
    value)` raises for a name not among `classes`."""
    index = {c.name: i for i, c in enumerate(classes)}
    out = np.empty(len(names), dtype=np.int64)
    for row, name in enumerate(names):
        found = index.get(name) if isinstance(name, str) else None
        if found is None:
            problem(row, name)
            raise AssertionError("problem() raises")
        out[row] = found
    return out


def draw_classes(classes: list[RequestClassConfig], num_requests: int, seed: int,
                 sessions: Sessions | None) -> np.ndarray:
    """Each request's class index, drawn by share from the scenario seed's own stream; the
    turns of a session share their session's draw."""
    rng = np.random.default_rng([seed, CLASS_STREAM])
    shares = np.array([c.share or 0.0 for c in classes])
    if sessions is None:
        return rng.choice(len(classes), size=num_requests, p=shares / shares.sum())
    per_session = rng.choice(len(classes), size=int(sessions.session.max()) + 1,
                             p=shares / shares.sum()) if num_requests else np.zeros(0, int)
    return per_session[sessions.session]

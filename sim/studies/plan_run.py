"""The whole search of a plan (`sim.studies.plan`), over local processes: kinds cheapest
first, dominated ones refused, the same answer whatever ran at once; and the objective a
deployment is ranked by."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict
from pathlib import Path
from typing import Any

from sim.studies.plan import Evaluation, Kind, KindResult, Searcher, kinds
from sim.studies.plan_file import GPUChoice, Plan

# Deployments costing more than this many times the best found are not searched for: the
# answer, and the cheapest alternatives checked across the error band, lie below it.
COST_REACH = 1.5

_SEARCHER: Searcher | None = None


def _init_worker(plan: Plan, out_dir: Path) -> None:
    import signal

    global _SEARCHER
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process decides what stops
    _SEARCHER = Searcher(plan, out_dir)


def _search_in_worker(kind: Kind, max_units: int | None) -> KindResult:
    assert _SEARCHER is not None
    return _SEARCHER.search(kind, max_units)


def _search_task(plan: Plan, out_dir: Path, kind: Kind, max_units: int | None) -> KindResult:
    """One kind's search as a Ray task (its runs cached in `out_dir`, which the cluster's
    nodes must share, as a sweep's)."""
    return Searcher(plan, out_dir).search(kind, max_units)


def unit_cost(plan: Plan, kind: Kind) -> float:
    """The objective for one replica (or P:D unit) of `kind`: USD an hour, or GPUs (a
    heterogeneous unit's decode replicas at their own GPU's price)."""
    if plan.config.objective == "gpus":
        return float(kind.num_gpus(1))
    prefill_gpus = kind.num_gpus(1)
    cost = 0.0
    if kind.ratio is not None and kind.ratio.decode_gpu is not None:
        decode_gpus = kind.ratio.decode * kind.decode_gpus_per_replica
        prefill_gpus -= decode_gpus
        cost += decode_gpus * _price(kind.ratio.decode_gpu)
    return cost + prefill_gpus * _price(kind.gpu)


def _price(choice: GPUChoice) -> float:
    """USD an hour of one GPU: the plan's price, else the GPU table's (inf: none known)."""
    if choice.cost_per_gpu_hour is not None:
        return choice.cost_per_gpu_hour
    from sim.hardware.gpus import GPUS

    price = GPUS.get(choice.name).cost_per_gpu_hour
    return math.inf if price is None else price


def objective(plan: Plan, ev: Evaluation) -> float:
    """What a deployment is ranked by, lower first: GPUs, else USD an hour."""
    if plan.config.objective == "gpus":
        return float(ev.num_gpus)
    return math.inf if ev.usd_per_hour is None else ev.usd_per_hour


def run_plan(plan: Plan, out_dir: Path, *, workers: int | None = 1, backend: str = "local",
             address: str | None = None,
             on_kind: Callable[[KindResult], None] | None = None) -> list[KindResult]:
    """Search every kind (cheapest first, `workers` at a time: local processes, or Ray tasks
    on the cluster at `address`, a local one without; None: as many as the cluster runs),
    refusing the dominated ones; the results in the order searched."""
    searcher = Searcher(plan, out_dir)
    todo = sorted(kinds(plan), key=lambda k: unit_cost(plan, k))
    best = math.inf

    def finished(result: KindResult) -> None:
        nonlocal best
        done[result.kind] = result
        if (ev := result.best()) is not None:
            best = min(best, objective(plan, ev))
        if on_kind is not None:
            on_kind(result)

    def dominated(kind: Kind, best: float) -> KindResult | None:
        cost = unit_cost(plan, kind)
        # (a tie is searched: the answer breaks ties by margin)
        if cost <= best or plan.config.objective == "load_per_dollar":
            return None
        what = "USD an hour" if plan.config.objective == "cost" else "GPUs"
        return KindResult(kind, refused=f"dominated: one {'unit' if kind.ratio else 'replica'} "
                                        f"already takes {cost:,.4g} {what}, more than the "
                                        f"best deployment of a cheaper kind ({best:,.4g})")

    def max_units(kind: Kind) -> int | None:
        """The most replicas (units) worth trying: no deployment costing more than
        COST_REACH times the best so far can be the answer or close to it."""
        if plan.config.objective == "load_per_dollar" or not math.isfinite(best):
            return None
        return max(1, math.floor(best * COST_REACH / unit_cost(plan, kind) + 1e-9))

    done: dict[Kind, KindResult] = {}
    if backend == "ray":
        _run_ray(plan, out_dir, todo, workers, address, finished,
                 lambda k: dominated(k, best), max_units)
    elif workers is None or workers <= 1:
        for kind in todo:
            finished(dominated(kind, best) or searcher.search(kind, max_units(kind)))
    else:
        _run_parallel(plan, out_dir, todo, workers, finished, lambda k: dominated(k, best),
                      max_units)
    # The same answer whatever ran at once: a kind is dominated when a cheaper kind's best
    # deployment costs no more than one of its replicas (one searched while that was not yet
    # known is set aside, its runs cached); a kind whose smallest deployment found costs more
    # than COST_REACH times the best is reported as such (a search started with the best
    # known would have stopped there).
    results, best = [], math.inf
    for kind in todo:
        result = dominated(kind, best) or done[kind]
        results.append(result)
        if (ev := result.best()) is not None:
            best = min(best, objective(plan, ev))
    for result in results:
        ev = result.best()
        if result.refused is None and (ev is None or objective(plan, ev) > best * COST_REACH):
            result.units = None
            result.beyond = best * COST_REACH if math.isfinite(best) else None
    return results


def _run_parallel(plan: Plan, out_dir: Path, todo: list[Kind], workers: int,
                  finished: Callable[[KindResult], None],
                  dominated: Callable[[Kind], KindResult | None],
                  max_units: Callable[[Kind], int | None]) -> None:
    """Search `todo` in order on `workers` processes (`_dispatch`)."""
    pool = ProcessPoolExecutor(max_workers=workers, initializer=_init_worker,
                               initargs=(plan, out_dir))

    def first_done(pending: Collection[Any]) -> Any:
        return next(iter(wait(pending, return_when=FIRST_COMPLETED)[0]))

    try:
        _dispatch(todo, workers, lambda kind: pool.submit(_search_in_worker, kind,
                                                          max_units(kind)),
                  first_done, lambda future: future.result(), finished, dominated)
    except BaseException:
        from sim.studies.workers import _stop

        _stop(pool)
        raise
    pool.shutdown()


def _run_ray(plan: Plan, out_dir: Path, todo: list[Kind], workers: int | None,
             address: str | None, finished: Callable[[KindResult], None],
             dominated: Callable[[Kind], KindResult | None],
             max_units: Callable[[Kind], int | None]) -> None:
    """`_run_parallel` with Ray tasks, at most `workers` at once (None: no cap)."""
    from sim.studies.workers import init_ray

    ray = init_ray(address, workers)
    remote = ray.remote(max_retries=0)(_search_task)
    plan_ref = ray.put(plan)
    pending: dict[Any, Kind] = {}
    try:
        _dispatch(todo, workers,
                  lambda kind: remote.remote(plan_ref, out_dir, kind, max_units(kind)),
                  lambda refs: ray.wait(list(refs), num_returns=1)[0][0], ray.get, finished,
                  dominated, pending)
    except BaseException:
        for ref in pending:  # a running task gets a KeyboardInterrupt and unwinds
            ray.cancel(ref)
        raise


def _dispatch(todo: list[Kind], workers: int | None, submit: Callable[[Kind], Any],
              first_done: Callable[[Collection[Any]], Any], result: Callable[[Any], KindResult],
              finished: Callable[[KindResult], None],
              dominated: Callable[[Kind], KindResult | None],
              pending: dict[Any, Kind] | None = None) -> None:
    """Start the kinds of `todo` in order, at most `workers` at once (None: no cap), a kind
    dominated by the results so far not started; `finished` each as it ends. `pending` (the
    handles still running) is the caller's, to cancel them on the way out."""
    pending = {} if pending is None else pending
    queue = list(reversed(todo))
    while queue or pending:
        while queue and (workers is None or len(pending) < workers):
            kind = queue.pop()
            if (refused := dominated(kind)) is not None:
                finished(refused)
                continue
            pending[submit(kind)] = kind
        if not pending:
            continue
        handle = first_done(pending)
        pending.pop(handle)
        finished(result(handle))


def evaluation_rows(results: list[KindResult]) -> list[dict[str, Any]]:
    """Every run as a flat row (the candidates table), refused kinds as a row each."""
    rows = []
    for result in results:
        if result.refused is not None:
            rows.append({"kind": result.kind.label(), "role": "refused", "why": result.refused})
        for ev in result.evaluations:
            row = asdict(ev)
            values = row.pop("values")
            row |= {f"{k}": v for k, v in values.items()}
            rows.append(row)
    return rows

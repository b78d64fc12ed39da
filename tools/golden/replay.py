"""servesim's side of a golden fixture: the same workload through servesim's policy and engine,
with the same step-time function, and the first place where the two schedules differ.

    python -m tools.golden.replay tests/golden/vllm-0.33.0/light.json.gz [...]

prints, per fixture, whether every step, preemption and request time is identical, or the
first divergence: the step, both sides' maps and preemptions, and the requests that differ.
Needs servesim only (no vLLM, no SGLang).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tools.golden.fixture import read_fixture
from tools.golden.workloads import prompt_token_ids

Step = tuple[float, float, list[tuple[int, int]], list[int]]


def scenario_data(doc: dict[str, Any], policy: str | None = None) -> dict[str, Any]:
    """The servesim scenario that stands for the fixture's engine settings; `policy`
    "vllm_engine" runs the installed vLLM's own scheduler instead of `vllm_v1`."""
    w = doc["workload"]
    s = w["settings"]
    if doc["engine"] == "vllm" and policy == "vllm_engine":
        scheduler: dict[str, Any] = {
            "name": "vllm_engine", **{k: s[k] for k in (
                "max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill",
                "long_prefill_token_threshold", "async_scheduling")},
            "scheduling_policy": s.get("scheduling_policy", "fcfs")}
        prefix_caching = s["enable_prefix_caching"]
    elif doc["engine"] == "vllm":
        scheduler = {
            "name": "vllm_v1", "engine_version": doc["engine_version"],
            "max_num_batched_tokens": s["max_num_batched_tokens"],
            "max_num_seqs": s["max_num_seqs"],
            "enable_chunked_prefill": s["enable_chunked_prefill"],
            "long_prefill_token_threshold": s["long_prefill_token_threshold"],
            "async_scheduling": s["async_scheduling"],
            "scheduling_policy": s.get("scheduling_policy", "fcfs")}
        if s.get("speculative"):
            # (The recorder's step time has no drafter in it.)
            scheduler["speculative"] = {**s["speculative"], "draft_time_ratio": 0.0}
        prefix_caching = s["enable_prefix_caching"]
    else:
        scheduler = {"name": "sglang", "engine_version": doc["engine_version"],
                     "chunked_prefill_size": s["chunked_prefill_size"],
                     "max_num_seqs": s["max_running_requests"],
                     "overlap_schedule": not s["disable_overlap_schedule"],
                     **{k: s[k] for k in ("enable_priority_scheduling",
                                          "schedule_low_priority_values_first",
                                          "priority_scheduling_preemption_threshold",
                                          "disable_priority_preemption")
                        if k in s}}
        if s.get("speculative"):
            # SGLang's `--speculative-algorithm` lower-cased; no drafter in the step time.
            spec = s["speculative"]
            scheduler["speculative"] = {**spec, "algorithm": spec["algorithm"].lower(),
                                        "draft_time_ratio": 0.0}
        if s.get("enable_hierarchical_cache"):
            scheduler["hierarchical_cache"] = hicache_config(s)
        prefix_caching = not s["disable_radix_cache"]
    step = w["step_time"]
    return {
        "name": f"golden-{w['name']}",
        "seed": w["seed"],  # (speculative decoding draws acceptance from it, as the recorder)
        # Not read: `replay` gives the cluster the fixture's requests itself.
        "workload": {"format": "synthetic", "num_requests": 1,
                     "arrivals": {"process": "poisson", "qps": 1.0},
                     "lengths": {"prompt": {"dist": "fixed", "value": 1},
                                 "output": {"dist": "fixed", "value": 1}}},
        "replica": {
            "scheduler": scheduler,
            "latency": {"kind": "linear", "base_s": step["base_s"],
                        "per_token_s": step["per_token_s"]},
            # (An SGLang workload's pool is in tokens, whole pages of `block_size`.)
            "kv_cache": {"block_size": w["block_size"],
                         "num_blocks": (w["num_gpu_blocks"] // w["block_size"]
                                        if doc["engine"] == "sglang" else w["num_gpu_blocks"])},
            "max_model_len": w["max_model_len"],
            "prefix_caching": prefix_caching,
            **({"kv_offload": offload_config(s["kv_offload"])} if s.get("kv_offload") else {}),
        },
    }


def offload_config(offload: dict[str, Any]) -> dict[str, Any]:
    """`replica.kv_offload` for a fixture's CPU tier: the host memory of its blocks (each
    `bytes_per_block`, the default model's), and the copy rate."""
    return {"size_gib": offload["num_cpu_blocks"] * offload["bytes_per_block"] / 2**30,
            "host_bandwidth_gb_s": offload["host_bandwidth_gb_s"],
            **{key: offload[key] for key in ("eviction_policy", "store_threshold")
               if key in offload}}


def hicache_config(settings: dict[str, Any]) -> dict[str, Any]:
    """`scheduler.hierarchical_cache` for a fixture's HiCache. The recorder lets a copy read
    done at the end of the first batch launched after it (`hicache_transfer` "next_batch",
    the GPU's case: `tools/golden/sglang_hicache.py`): servesim's copies on the fastest link
    it takes end just after their fence, so each ack is taken at that same pass. With
    "bandwidth" the recorder times copies as servesim does, at the fixture's
    `hicache_host_bandwidth_gb_s`, a token's KV that of servesim's default model."""
    transfer = settings.get("hicache_transfer", "next_batch")
    if transfer == "bandwidth":
        bandwidth = settings["hicache_host_bandwidth_gb_s"]
    elif transfer == "next_batch":
        bandwidth = 10_000
    else:
        raise ValueError(f"hicache_transfer {transfer!r}: only next_batch (a copy hidden "
                         "behind the next batch) and bandwidth are replayed")
    return {"ratio": settings.get("hicache_ratio", 2.0),
            "write_policy": settings.get("hicache_write_policy", "write_through"),
            "host_bandwidth_gb_s": bandwidth}


def requests_of(doc: dict[str, Any]) -> list[Any]:
    """The fixture's requests as servesim's, with a prefix-block id per full block of the
    prompt (shared blocks share ids, as the engine's block hashes do)."""
    from sim.core.request import Request

    w = doc["workload"]
    block = w["block_size"]
    reqs = []
    for rid, (arrival_s, num_prompt, num_output, group, _, *rest) in enumerate(w["requests"]):
        hash_ids = None
        if group >= 0:
            tokens = prompt_token_ids(w, rid)
            # An id per full block, chained from the block before it (as vLLM chains block
            # hashes): equal ids mean equal prefixes.
            ids = []
            last = 0
            for i in range(num_prompt // block):
                last = hash((last, *tokens[i * block:(i + 1) * block]))
                ids.append(last)
            hash_ids = tuple(ids)
        reqs.append(Request(rid, arrival_s, num_prompt, num_output, hash_ids,
                            block if hash_ids else 0, priority=rest[0] if rest else 0,
                            ignore_eos=w["settings"].get("ignore_eos", True)))
    return reqs


@dataclass
class Replayed:
    steps: list[Step]
    requests: list[list[Any]]  # first_scheduled_s, first_token_s, finish_s, num_preemptions
    stalled: bool = False  # requests left that servesim says the engine never runs
    host: dict[str, int] | None = None  # a hierarchical cache's totals (`host_totals`)
    # The bytes a token's copy to or from the host moves (a drafter's layers too), by the
    # hierarchical cache's copy rate
    copy_bytes_per_token: float | None = None


def replay(doc: dict[str, Any], *, fast_forward: bool = False, policy: str | None = None
           ) -> Replayed:
    """Run servesim on the fixture's workload; every iteration's plan, and request times."""
    from sim.config.scenario import parse_scenario
    from sim.core.hicache import HierarchicalCache
    from sim.engine.cluster import Cluster

    scenario = parse_scenario(scenario_data(doc, policy),
                              f"<golden {doc['workload']['name']}>")
    cluster = Cluster(scenario, fast_forward=fast_forward)
    replica = cluster.replicas[0]
    replica.plans = []
    requests = requests_of(doc)
    cluster.run(list(requests))
    log = replica.log
    starts = log.columns["start_s"]
    ends = log.end_s().tolist()
    taken = log.output_s().tolist()  # (a token leaves when the engine takes its result)
    steps: list[Step] = [
        (starts[i], ends[i], list(plan.num_scheduled_tokens.items()), list(plan.preempted_ids))
        for i, plan in enumerate(replica.plans)]
    first_iter: dict[int, int] = {}
    for rid, it in zip(*(a.tolist() for a in log.sampled_tokens()), strict=True):
        first_iter[rid] = min(first_iter.get(rid, it), it)
    times = []
    for req in requests:
        runs = req.all_token_runs()
        it = runs[0][1] if runs else first_iter.get(req.request_id)
        times.append([req.first_scheduled_s, None if it is None else taken[it], req.finish_s,
                      req.num_preemptions])
    stalled = any((req.reason or "").startswith("engine_stalled") for req in requests)
    host = None
    kv = replica.state.kv
    if isinstance(kv, HierarchicalCache):
        c = kv.counters
        host = {"loads": c.num_hit_requests, "loaded_tokens": c.num_hit_tokens,
                "written_tokens": c.num_stored_blocks, "host_evicted_tokens":
                c.num_evicted_blocks, "gpu_evicted_tokens": kv.num_evicted_blocks,
                "host_used_tokens_at_end": kv.num_host_used_blocks,
                "host_pool_tokens": kv.num_host_blocks}
    copy_bytes = None
    if replica.host_copies is not None:
        bandwidth = scenario.replica.scheduler.hierarchical_cache.host_bandwidth_gb_s
        copy_bytes = (replica.host_copies.s_per_block * bandwidth * 1e9
                      / scenario.replica.kv_cache.block_size)
    return Replayed(steps, times, stalled, host, copy_bytes)


def host_totals(doc: dict[str, Any]) -> dict[str, int]:
    """What the engine's hierarchical cache did over a fixture (the recorder's per-step
    `hicache` record, summed; its blocks are tokens): loads, tokens loaded back, written to
    the host, evicted from the host and from the GPU, the host pool's use at the end."""
    record = doc["hicache"]
    steps = [*record["steps"], record["tail"]]
    loaded = [n for step in steps for _, _, n in step["loaded"]]
    return {"loads": sum(1 for n in loaded if n), "loaded_tokens": sum(loaded),
            "written_tokens": sum(step["written"] for step in steps),
            "host_evicted_tokens": sum(step["host_evicted"] for step in steps),
            "gpu_evicted_tokens": sum(step["evicted"] for step in steps),
            "host_used_tokens_at_end": steps[-1]["host_used"],
            "host_pool_tokens": record["host_pool_tokens"]}


def engine_steps(doc: dict[str, Any]) -> list[Step]:
    """The fixture's steps, an engine step that scheduled nothing folded into the next (a
    simulated iteration is never empty: servesim logs those preemptions with the next plan)."""
    steps: list[Step] = []
    carried: list[int] = []
    for start_s, end_s, scheduled, preempted in doc["steps"]:
        if not scheduled:
            carried += preempted
            continue
        steps.append((start_s, end_s, [(r, n) for r, n in scheduled], carried + preempted))
        carried = []
    return steps


def first_divergence(doc: dict[str, Any], replayed: Replayed) -> str | None:
    """None if servesim's schedule is the engine's, step for step; else what differs first."""
    name = f"{doc['engine']}-{doc['engine_version']} {doc['workload']['name']}"
    want = engine_steps(doc)
    got = replayed.steps
    for index, (w, g) in enumerate(zip(want, got, strict=False)):
        if w != g:
            what = [label for label, a, b in (("start", w[0], g[0]), ("end", w[1], g[1]),
                                             ("scheduled", w[2], g[2]),
                                             ("preempted", w[3], g[3])) if a != b]
            return (f"{name}: step {index} differs ({', '.join(what)}):\n"
                    f"  engine   t={w[0]!r}..{w[1]!r} scheduled={_short(w[2])} "
                    f"preempted={w[3]}\n"
                    f"  servesim t={g[0]!r}..{g[1]!r} scheduled={_short(g[2])} "
                    f"preempted={g[3]}" + _diff(w[2], g[2]))
    if len(want) != len(got):
        return f"{name}: engine ran {len(want)} steps, servesim {len(got)}"
    if replayed.stalled != bool(doc["workload"].get("stalls")):
        return (f"{name}: the engine {'waits for ever' if not replayed.stalled else 'ran'} "
                f"with requests left, servesim {'says so' if replayed.stalled else 'ran on'}")
    if "hicache" in doc and replayed.host != (want_host := host_totals(doc)):
        assert replayed.host is not None
        bad = [f"{k} {v!r} vs {replayed.host[k]!r}" for k, v in want_host.items()
               if replayed.host[k] != v]
        return f"{name}: the hierarchical cache differs (engine vs servesim): {'; '.join(bad)}"
    want_bytes = doc.get("hicache", {}).get("bytes_per_token")
    if want_bytes is not None and round(replayed.copy_bytes_per_token or 0) != want_bytes:
        return (f"{name}: a token's copy moves {want_bytes} bytes in the engine (its drafter's "
                f"layers too), {replayed.copy_bytes_per_token!r} in servesim")
    fields = ("first_scheduled_s", "first_token_s", "finish_s", "num_preemptions")
    for rid, (w, g) in enumerate(zip(doc["requests"], replayed.requests, strict=True)):
        if list(w) != list(g):
            bad = [f"{f} {a!r} vs {b!r}" for f, a, b in zip(fields, w, g, strict=True)
                   if a != b]
            return f"{name}: request {rid} differs (engine vs servesim): {'; '.join(bad)}"
    return None


def _short(pairs: list[tuple[int, int]]) -> str:
    text = "{" + ", ".join(f"{r}: {n}" for r, n in pairs) + "}"
    return text if len(text) <= 400 else text[:400] + f"... ({len(pairs)} requests)"


def _diff(want: list[tuple[int, int]], got: list[tuple[int, int]]) -> str:
    w, g = dict(want), dict(got)
    only_w = {r: n for r, n in w.items() if g.get(r) != n}
    only_g = {r: n for r, n in g.items() if w.get(r) != n}
    if not only_w and not only_g:
        return "\n  (same map, other order)" if want != got else ""
    return f"\n  engine only: {only_w}\n  servesim only: {only_g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("fixtures", nargs="+", type=Path)
    parser.add_argument("--policy", choices=["vllm_engine"],
                        help="replay vLLM fixtures with the installed vLLM's own scheduler")
    args = parser.parse_args(argv)
    bad = 0
    for path in args.fixtures:
        doc = read_fixture(path)
        if args.policy and doc["engine"] != "vllm":
            continue
        problem = first_divergence(doc, replay(doc, policy=args.policy))
        n = len(engine_steps(doc))
        print(problem or f"{doc['engine']}-{doc['engine_version']} {doc['workload']['name']}: "
                         f"identical ({n} steps, {len(doc['requests'])} requests)")
        bad += problem is not None
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

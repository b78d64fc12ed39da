"""The closed forms the fast path of async and overlapped replicas uses
(`sim.engine.fastpath.async_stretch`; `bench/README.md`, "Stretches for async and overlapped
replicas") checked against stepped runs, bit for bit, apart from the fast path's own code.

    python tools/async_stretch_check.py [--case default|azure] [--num-requests N]
        [--scheduler vllm_v1|sglang] [--noise SIGMA] [--num-blocks B --qps Q]

It runs one replica stepped (its scheduler async or overlapped, as the engines default) and
notes, at every plan that could open a stretch (nothing waiting, every running request in it,
each decoding or given all its known tokens: a new prompt whole beside the decodes), what a
stretch planner would read; a plan with prompts, its iteration's duration as the step times
it. After the run it predicts with numpy, from
those notes alone, every would-be stretch's iterations (starts, logged durations, batch
sizes, KV blocks in use at each plan: a finished request's blocks come back one plan later
than on a synchronous replica), its requests' finish times and sampled tokens, and compares
them with the log. Exit 1 on any mismatch. The stretch runs while the following plans stay
decode-only with nothing waiting (through finishes), at most 128 iterations.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sim.engine.pipeline as pipeline  # noqa: E402
from sim import load_scenario, run_scenario, traces_dir  # noqa: E402
from sim.config.scenario import parse_scenario  # noqa: E402
from sim.engine.fastpath.stretch import batch_sizes  # noqa: E402
from sim.latency.base import BatchShape  # noqa: E402

MAX_STEPS = 128


def record_plans(notes: dict[int, dict[str, Any]], steady: dict[int, tuple[bool, bool]],
                 holder: dict[str, Any]) -> None:
    """Wrap `PipelinedReplica._send` to note each plan: whether it is decode-only with
    nothing waiting, whether it could open a stretch, and then what a planner reads."""
    send = pipeline.PipelinedReplica._send

    def noting(self: Any, plan: Any, now_s: float, it: Any = None) -> Any:
        state = self.state
        holder["replica"] = self
        index = len(self.log) + len(self._batches)
        decode_only = (plan.total_num_scheduled_tokens == plan.num_seqs
                       and not state.prefilling())
        calm = (not state.waiting and decode_only and not plan.preempted_ids
                and not self._preempted)
        running = list(state.running)
        tokens = plan.num_scheduled_tokens
        # Prompts beside the decodes, each given all its known tokens: every request samples
        # at the end of this iteration, and is counted as if it had decoded in it.
        catches_up = (not state.waiting and not plan.preempted_ids and not self._preempted
                      and not decode_only and len(tokens) == len(running)
                      and all(r.num_computed_tokens + tokens.get(r.request_id, 0)
                              == r.num_tokens for r in running))
        steady[index] = (calm, catches_up or (calm and plan.num_seqs == len(state.running)))
        if steady[index][1]:
            notes[index] = {
                "plan_s": now_s, "free_s": self._stage_free_s[0],
                "pred_end_s": self._batches[-1].end_s if self._batches else None,
                "used": state.kv.num_used_blocks,
                "ids": [r.request_id for r in running],
                "computed": [r.num_computed_tokens for r in running],
                "left": [r.num_target_output_tokens - r.num_output_tokens for r in running]}
            if catches_up:
                notes[index]["computed"] = [r.num_computed_tokens + tokens[r.request_id] - 1
                                            for r in running]
                notes[index]["first_s"] = self._plan_iteration(
                    plan, now_s, len(self._batches)).duration_s
        return send(self, plan, now_s, it)

    pipeline.PipelinedReplica._send = noting  # type: ignore[method-assign]


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--case", choices=["default", "azure"], default="default")
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--scheduler", choices=["vllm_v1", "sglang"], default="vllm_v1")
    parser.add_argument("--noise", type=float, default=0.0, help="lognormal sigma")
    parser.add_argument("--num-blocks", type=int, help="a tight KV cache")
    parser.add_argument("--qps", type=float, default=5.5)
    args = parser.parse_args()
    if args.case == "default":
        data = load_scenario().model_dump(mode="json")
        data["workload"]["num_requests"] = args.num_requests
    else:
        data = {"name": "azure", "workload": {
                    "format": "azure", "num_requests": args.num_requests,
                    "path": str(traces_dir() / "azure_llm_2023"
                                / "AzureLLMInferenceTrace_conv.csv")},
                "replica": {"model": "llama-3.1-8b", "gpu": "h100-sxm",
                            "latency": {"kind": "roofline"}}}
    data["replica"]["scheduler"] = {"name": args.scheduler}
    if args.noise:
        data["replica"]["latency"]["noise"] = {"kind": "lognormal", "sigma": args.noise}
    if args.num_blocks:
        data["replica"]["kv_cache"] = {"num_blocks": args.num_blocks}
        data["workload"]["arrivals"] = {"process": "poisson", "qps": args.qps}
    data["record_token_times"] = True
    notes: dict[int, dict[str, Any]] = {}
    steady: dict[int, tuple[bool, bool]] = {}
    holder: dict[str, Any] = {}
    record_plans(notes, steady, holder)
    # Stepped: the fast path would take these plans (`sim.engine.fastpath.pipeline`).
    res = run_scenario(parse_scenario(data, "tools/async_stretch_check.py"), fast_forward=False)
    replica = holder["replica"]
    log = replica.log.arrays()
    num_iterations = len(log["start_s"])
    block_size = replica.state.kv.block_size
    pairs = set(zip(*(a.tolist() for a in replica.log.sampled_tokens()), strict=True))
    finish = dict(zip(res.requests["request_id"], res.requests["finish_s"], strict=True))
    checked = mismatches = covered = opened_by_prompts = 0
    i = 0
    while i < num_iterations:
        if not steady[i][1]:
            i += 1
            continue
        n = 1
        while i + n < num_iterations and n < MAX_STEPS and steady[i + n][0]:
            n += 1
        note = notes[i]
        computed, left = note["computed"], note["left"]
        num_seqs, kv_tokens = batch_sizes(computed, left, n)
        shape = BatchShape.decode_only(num_seqs, kv_tokens)
        iteration_s = np.broadcast_to(np.asarray(replica.latency.iteration_time_s(shape),
                                                 dtype=float), (n,))
        host_s = replica.latency.host_time_s(shape)
        duration = np.maximum(iteration_s - host_s, host_s)
        if replica.noise is not None:
            duration = duration * replica.noise.factors_from(i, n, 0, num_seqs)
        prompts = "first_s" in note  # (iteration 0 computed prompts: timed as its step)
        if prompts:
            duration = np.concatenate(([note["first_s"]], duration[1:]))
        start0 = max(note["plan_s"], note["free_s"])
        raw_end = np.add.accumulate(np.concatenate(([start0], duration)))[1:]
        starts = np.concatenate(([start0], raw_end[:-1]))
        logged = raw_end - starts
        ends = starts + logged
        # Plan j is made when j - 2 ends (plan 1 when the iteration in flight ends).
        pred = note["pred_end_s"] if note["pred_end_s"] is not None else note["plan_s"]
        plan_s = np.concatenate(([note["plan_s"], pred], ends[:-2]))[:n]
        ok = bool((plan_s <= starts).all())
        change = np.zeros(n + 2, dtype=np.int64)
        for c, k in zip(computed, left, strict=True):
            j = -c % block_size or block_size
            while j < min(k, n):
                change[j] += 1
                j += block_size
            if k + 1 <= n:  # freed after plan k: from plan k + 1
                change[k + 1] -= -(-(c + k) // block_size)
        used = note["used"] + np.cumsum(change[:n])
        rows, decodes = slice(i, i + n), slice(i + prompts, i + n)
        seqs = np.broadcast_to(num_seqs, (n,))
        ok = (ok and np.array_equal(log["start_s"][rows], starts)
              and np.array_equal(log["duration_s"][rows], logged)
              and np.array_equal(log["num_seqs"][rows], seqs)
              and np.array_equal(log["num_decode_tokens"][decodes], seqs[prompts:])
              and bool((log["num_prefill_tokens"][decodes] == 0).all())
              and np.array_equal(log["num_kv_blocks_used"][rows], used))
        for rid, k in zip(note["ids"], left, strict=True):
            if k <= n and finish[rid] != ends[k - 1]:
                ok = False
            if any((rid, i + j) not in pairs for j in range(min(k, n))):
                ok = False
        if not ok and mismatches < 3:
            print(f"mismatch: the stretch from iteration {i} ({n} iterations)")
        mismatches += not ok
        checked += 1
        opened_by_prompts += prompts
        covered += n
        i += n
    print(f"{args.case} {args.scheduler}: {checked} stretches ({opened_by_prompts} opened by "
          f"prompts), {covered} of {num_iterations} iterations "
          f"({covered / max(num_iterations, 1):.1%}) predicted; {mismatches} mismatches")
    return 1 if mismatches or not checked else 0


if __name__ == "__main__":
    sys.exit(main())

"""Record golden schedules from the installed SGLang's own scheduler WITH speculative decoding
(`--speculative-algorithm` EAGLE, EAGLE3, STANDALONE, NGRAM), on a CPU, on a virtual clock.

Run it in SGLang's venv (never servesim's), from the repository root:

    /root/venv-sglang/bin/python tools/golden/record_sglang_spec.py --out tests/golden [NAME ...]

The workloads are `SGLANG_SPEC_WORKLOADS` (`workloads_sglang.py`): `settings.speculative` =
{algorithm (SGLang's name), num_steps, eagle_topk, num_draft_tokens, acceptance_rate}, and
`settings.unset` the SGLang arguments left to SGLang (the workload holds what it resolves them
to: checked). Each is recorded in a fresh process (SGLang's server arguments are process-wide).

What runs for real: everything `record_sglang.py` drives (its docstring: the same
`_loop_normal` / `_loop_overlap`, request receiver, clock, retraction and preemption hooks),
with the Scheduler built with `speculative_algorithm`, `speculative_num_steps`,
`speculative_eagle_topk` (NGRAM: `speculative_ngram_max_bfs_breadth`),
`speculative_num_draft_tokens` and, for EAGLE / EAGLE3 / STANDALONE, a draft model (a one-layer
dummy-weight `LlamaForCausalLMEagle` / `LlamaForCausalLMEagle3` / `LlamaForCausalLM` of the
target's vocabulary). SGLang resolves its own defaults (`arg_groups/speculative_hook.py`:
`max_running_requests` 48, the auto (steps, topk, draft tokens), NGRAM's), builds its own spec
worker (`EAGLEWorkerV2`, `StandaloneWorkerV2`, `NGRAMWorker`) and draft KV pool, and does all
of its speculative batch preparation and KV bookkeeping itself: `eagle_prepare_for_decode`'s
KV top-up (committed + 2 * max(steps * topk, draft tokens) slots), `check_decode_mem`,
`retract_decode` (and its abort of the last request), the draft passes, tree building,
verification, draft extend, the overlap loop's future map and `_resolve_spec_v2_tokens`, KV
commits and frees, `_reqs_finishing_inflight`.

What is replaced (`sglang_spec_patches.py`), and why it decides nothing about the schedule:
* `sgl_kernel`'s `*_cpu` index ops, missing from the PyPI wheel: torch stand-ins
  (`sglang_cpu_ops.py`, checked equal to SGLang's Triton kernels by
  `check_sglang_cpu_ops.py`); they fill slot tables, tree links and masks and move KV rows.
* Attention (torch_native has no tree verify or multi-step draft support): every attention
  call writes its K/V into the pool at `out_cache_loc` and returns zeros. It only changes the
  values the model computes, which acceptance (below) overrides anyway.
* The overlap loop's `gather_spec_extras` (Triton only): the same row gather in torch; and
  `_disable_overlap_schedule_for_cpu`, which turns the overlap loop off for speculative
  decoding on a CPU because of those kernels, is a no-op when the workload asks for the overlap
  loop (`disable_overlap_schedule` false).
* NGRAM's proposer (`NgramCorpus.batch_get`, a lookup in the tokens seen): a chain of D - 1
  drafts for every request, so that acceptance is not capped by what the corpus finds among
  the recorder's synthetic tokens. Drafts are data; every request verifies D tokens either way.
* The EAGLE draft's top-k probabilities (topk > 1 only): fixed at 0.9, 0.09, ... per branch,
  so that every tree holds a path num_steps deep (a dummy draft's near-uniform ones give trees
  of any shape). The draft's tokens and the tree's size are unchanged.
* Acceptance: the target's verify logits are set so that SGLang's own greedy verification
  accepts `Acceptance(draws, seed).accepted(rid, num_output_tokens, D - 1)` drafts
  (servesim's `sim.core.speculative`, the one servesim module imported, pure Python), along
  the tree's deepest path. `draws` has D - 1 rates: the acceptance rate at every position for
  NGRAM; for the EAGLE family at the first num_steps positions (a path is num_steps deep) and
  0 after, as servesim's `SGLangSpeculativeConfig.draws()`. `num_output_tokens` is the
  request's output length before the verify (its KV length - its prompt + 1: the last sampled
  token is not in the KV yet). How many tokens a request gains per step is the workload's
  data, as the output lengths are.

Recorded as `record_sglang.py` records (steps, requests), with a decode step's entry
[request id, num_draft_tokens] (the tokens the target verifies per request), plus
`accepted`: per step [[request id, drafts accepted], ...] (empty for a prefill),
`output_overshoot`: per request the tokens SGLang kept past max_new_tokens (a verify's accepted
run is not cut at the limit), and `aborted`: the request ids `retract_decode` aborted (their
finish_s is null).

With `settings.enable_hierarchical_cache` (`SGLANG_SPEC_HICACHE_WORKLOADS`) the scheduler is
built with HiCache as `record_sglang.py` builds it (`sglang_hicache.py`'s patches, its copies
timed at the workload's bandwidth with the drafter's KV layers SGLang's spec worker gave a
host pool), and the fixture holds `hicache` too.

With `settings.ignore_eos` false (the `spec_eos_*` workloads) the requests are sent without
ignore_eos, as `record_sglang.py` sends them, and the target and draft models have no EOS
token (`record_sglang.model_config`), so each request still runs to its max_new_tokens (checked).

With the radix cache on (`disable_radix_cache` false) SGLang's own tree (`UnifiedRadixCache`,
keyed by token pairs for the EAGLE family, by tokens for NGRAM) matches, inserts and evicts as
it does; its evictions are logged (stderr), not recorded. At the end every KV slot must be free
or held by the tree with no request holding it (`check_pools_idle`).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
os.environ.setdefault("PYTHONHASHSEED", "0")
# SGLang's own KV leak checks raise instead of warning: when idle (`on_idle`) and, in the
# overlap loop, every iteration (`self_check_during_busy`).
os.environ.setdefault("SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE", "1")
os.environ.setdefault("SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from sim.core.speculative import Acceptance  # noqa: E402  (pure Python)
from tools.golden import record_sglang as R  # noqa: E402
from tools.golden.fixture import write_fixture  # noqa: E402
from tools.golden.workloads import Workload  # noqa: E402
from tools.golden.workloads_sglang import (  # noqa: E402
    SGLANG_SPEC_HICACHE_WORKLOADS,
    SGLANG_SPEC_WORKLOADS,
)

WORKLOADS = {**SGLANG_SPEC_WORKLOADS, **SGLANG_SPEC_HICACHE_WORKLOADS}

# The draft model of each algorithm that has one (one layer, the target's config otherwise).
DRAFT_ARCHITECTURES = {"EAGLE": "LlamaForCausalLMEagle", "EAGLE3": "LlamaForCausalLMEagle3",
                       "STANDALONE": "LlamaForCausalLM"}
# settings.speculative's numbers -> SGLang's arguments (NGRAM takes its topk as its BFS breadth).
SPEC_ARGUMENTS = {"num_steps": "speculative_num_steps", "eagle_topk": "speculative_eagle_topk",
                  "num_draft_tokens": "speculative_num_draft_tokens"}


def acceptance_draws(spec: dict[str, Any]) -> list[float]:
    """The conditional acceptance rate of each of the D - 1 drafts a verify holds."""
    rate, steps, draft = spec["acceptance_rate"], spec["num_steps"], spec["num_draft_tokens"]
    assert isinstance(rate, float)
    if spec["algorithm"] == "NGRAM":
        return [rate] * (draft - 1)
    return [rate] * steps + [0.0] * (draft - 1 - steps)


def build_spec_scheduler(workload: Workload, model_dir: str) -> Any:
    """SGLang's Scheduler for the workload, as `record_sglang.build_scheduler` builds it, with
    speculative decoding on; the numbers SGLang resolves are checked against the workload."""
    R._stub_sgl_kernel_ops()  # (before the patches import SGLang)
    from tools.golden import sglang_spec_patches as P

    P.install_null_attention()
    P.install_overlap_gather()
    s, spec = workload["settings"], workload["settings"]["speculative"]
    algorithm, unset = spec["algorithm"], set(s.get("unset", ()))
    assert unset <= {"max_running_requests", *SPEC_ARGUMENTS.values()}, unset
    if not s["disable_overlap_schedule"]:
        P.allow_overlap_on_cpu()
    if algorithm == "NGRAM":
        P.propose_full_ngram_chains()
    else:
        P.shape_draft_trees()
    from sglang.srt.runtime_context import get_spec

    kw: dict[str, Any] = {"speculative_algorithm": algorithm}
    for key, argument in SPEC_ARGUMENTS.items():
        if argument not in unset:
            name = ("speculative_ngram_max_bfs_breadth"
                    if algorithm == "NGRAM" and key == "eagle_topk" else argument)
            kw[name] = spec[key]
    if algorithm in DRAFT_ARCHITECTURES:
        draft_dir = Path(model_dir, "draft")
        draft_dir.mkdir()
        (draft_dir / "config.json").write_text(json.dumps(
            {**R.model_config(workload), "architectures": [DRAFT_ARCHITECTURES[algorithm]],
             "draft_vocab_size": R.LLAMA_CONFIG["vocab_size"]}))
        kw["speculative_draft_model_path"] = str(draft_dir)
    sched = R.build_scheduler(workload, model_dir, **kw)
    # The speculative numbers SGLang runs with are the workload's.
    assert sched.spec_algorithm.name == algorithm, sched.spec_algorithm
    resolved = get_spec()
    got = {key: getattr(resolved, argument) for key, argument in SPEC_ARGUMENTS.items()}
    assert got == {key: spec[key] for key in SPEC_ARGUMENTS}, got
    return sched


class SpecRecorder(R._Recorder):
    """record_sglang's clock and record; a verify step computes num_draft_tokens per request;
    what each verify accepted, and the aborted requests, are kept too."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        spec = self.workload["settings"]["speculative"]
        self.num_draft_tokens = spec["num_draft_tokens"]
        self.acceptance = Acceptance(acceptance_draws(spec), self.workload["seed"])
        self.accepted: list[list[list[int]]] = []  # per step
        # Per verify of a request: (id, its outputs before it, accepted, its retractions).
        self.draws: list[tuple[int, int, int, int]] = []
        self.aborted: list[int] = []

    def launch(self, batch: Any) -> float:
        if batch.forward_mode.is_extend():
            scheduled = [[int(r.rid), int(n)] for r, n in zip(batch.reqs, batch.extend_lens,
                                                             strict=True)]
        else:
            assert batch.forward_mode.is_decode(), batch.forward_mode
            scheduled = [[int(r.rid), self.num_draft_tokens] for r in batch.reqs]
        total = sum(n for _, n in scheduled)
        start_s = max(self.now_s, self.gpu_free_s)
        forward_s = self.base_s + self.per_token_s * total
        if self.hicache is not None:  # (with "bandwidth", the loads it carries)
            forward_s = self.hicache.clock.duration_s(forward_s)
        end_s = start_s + forward_s
        self.gpu_free_s = end_s
        self.steps.append([start_s, end_s, scheduled, list(self.retracted)])
        self.accepted.append([])
        for rid, _ in scheduled:
            if self.times[rid]["first_scheduled_s"] is None:
                self.times[rid]["first_scheduled_s"] = start_s
        return end_s

    def draw(self, req: Any, seq_len: int) -> int:
        """Drafts `req` accepts in the verify being run (its KV length `seq_len` before it)."""
        num_output = seq_len - len(req.origin_input_ids) + 1
        if not self.sched.enable_overlap:  # (results are processed before the next batch)
            assert num_output == len(req.output_ids), (req.rid, num_output, len(req.output_ids))
        a = self.acceptance.accepted(int(req.rid), num_output, self.num_draft_tokens - 1)
        self.draws.append((int(req.rid), num_output, a, int(req.retraction_count)))
        return a

    def on_verify(self, batch: Any, accepted: list[int]) -> None:
        self.accepted[-1].extend([int(r.rid), a] for r, a in zip(batch.reqs, accepted,
                                                                 strict=True))

    def check_draws(self) -> None:
        """A request's outputs before a verify are those before its previous verify plus what
        that one accepted plus the bonus token, unless it was retracted in between."""
        last: dict[int, tuple[int, int, int]] = {}
        for rid, n, a, retractions in self.draws:
            if rid not in last:  # its first verify follows its prefill's token
                assert n == 1 or retractions, (rid, n)
            elif last[rid][2] == retractions:
                assert n == last[rid][0] + last[rid][1] + 1, (rid, n, last[rid])
            last[rid] = (n, a, retractions)


def record(workload: Workload) -> dict[str, Any]:
    """Drive SGLang's scheduler through `workload`; the fixture's body."""
    ignore_eos = workload["settings"].get("ignore_eos", True)
    with tempfile.TemporaryDirectory() as model_dir:
        Path(model_dir, "config.json").write_text(json.dumps(R.model_config(workload)))
        sched = build_spec_scheduler(workload, model_dir)
    assert ignore_eos or not sched.model_config.hf_eos_token_id, sched.model_config.hf_eos_token_id
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.schedule_policy import PrefillAdder

    from tools.golden import sglang_spec_patches as P

    retracted: list[int] = []
    receiver = R._Receiver()
    sched.request_receiver = receiver
    rec = SpecRecorder(workload, sched, receiver, retracted)
    P.impose_acceptance(rec.draw, rec.on_verify)
    if workload["settings"].get("enable_hierarchical_cache"):
        from tools.golden import sglang_hicache

        assert sglang_hicache.CLOCK is not None
        rec.hicache = sglang_hicache.HiCacheLog(sched, sglang_hicache.CLOCK, rec)
    original_retract = ScheduleBatch.retract_decode

    def retract_decode(self: Any) -> Any:
        out = original_retract(self)
        retracted.extend(int(r.rid) for r in out[0])
        rec.aborted.extend(int(r.rid) for r in out[2])
        return out

    ScheduleBatch.retract_decode = retract_decode  # type: ignore[method-assign]
    original_preempt = PrefillAdder.preempt_to_schedule

    def preempt_to_schedule(self: Any, req: Any) -> Any:
        before = len(self.preempt_list)
        out = original_preempt(self, req)
        retracted.extend(sorted(int(r.rid) for r in self.preempt_list[before:]))
        return out

    PrefillAdder.preempt_to_schedule = preempt_to_schedule  # type: ignore[method-assign]
    # (Counted for the log only: the radix cache's evictions (`UnifiedRadixCache._evict`, under
    # `evict` and `evict_for_alloc`): [walks that evicted, tokens evicted, tokens cached at the
    # end].)
    evictions = [0, 0, 0]
    original_evict = sched.tree_cache._evict

    def evict(*args: Any, **kwargs: Any) -> Any:
        out = original_evict(*args, **kwargs)
        if out.num_tokens_evicted:
            evictions[0] += 1
            evictions[1] += int(out.num_tokens_evicted)
        return out

    sched.tree_cache._evict = evict
    if workload["settings"]["disable_overlap_schedule"]:
        R._loop_normal(rec)
    else:
        R._loop_overlap(rec)
    rec.check_draws()
    del sched.tree_cache._evict  # (SGLang's again, for check_pools_idle)
    evictions[2] = int(sched.tree_cache.evictable_size())
    times, handles, arrivals = rec.times, rec.handles, rec.arrivals
    aborted = set(rec.aborted)
    unfinished = [rid for rid, t in times.items() if t["finish_s"] is None and rid not in aborted]
    assert not unfinished and len(times) == len(arrivals), unfinished[:5]
    # (Before the idle check, whose eviction of the whole tree backs nodes up with write_back.)
    hicache = rec.hicache.body() if rec.hicache is not None else None
    check_pools_idle(sched, workload["num_gpu_blocks"])
    if not workload["settings"]["disable_radix_cache"]:
        print(f"{workload['name']}: radix cache: {evictions[0]} evictions of "
              f"{evictions[1]} tokens, {evictions[2]} tokens still cached at the end",
              file=sys.stderr)
    overshoot = []
    for rid in range(len(arrivals)):
        n, want = len(handles[rid].output_ids), arrivals[rid][2]
        if rid not in aborted:  # a verify may run past max_new_tokens, by fewer than D tokens
            assert want <= n < want + rec.num_draft_tokens, (rid, n, want)
        assert handles[rid].sampling_params.ignore_eos == ignore_eos
        overshoot.append(max(0, n - want))
    body = {"steps": rec.steps,
            "requests": [[times[r]["first_scheduled_s"], times[r]["first_token_s"],
                          times[r]["finish_s"], int(handles[r].retraction_count)]
                         for r in range(len(arrivals))],
            "accepted": rec.accepted, "output_overshoot": overshoot, "aborted": rec.aborted}
    if hicache is not None:
        body["hicache"] = hicache
        assert len(hicache["steps"]) == len(rec.steps)
    return body


def check_pools_idle(sched: Any, total: int) -> None:
    """Every request slot is back, and every KV slot is free or held by the radix cache with
    no request holding it: SGLang's own idle check (`on_idle`: available + evictable +
    protected == total, `invariant_checker._check_full_pool`) with nothing protected. Then
    the tree is evicted whole, which must give back exactly the slots it held (the radix
    cache off, it holds none and the pool is whole already)."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    allocator, cache = sched.token_to_kv_pool_allocator, sched.tree_cache
    free, cached = allocator.available_size(), cache.evictable_size()
    assert cache.protected_size() == 0, cache.protected_size()
    assert free + cached == total, (free, cached, total)
    if cached:
        assert cache.evict(EvictParams(num_tokens=cached)).num_tokens_evicted == cached
    assert (allocator.available_size(), cache.evictable_size()) == (total, 0), (
        allocator.available_size(), cache.evictable_size())
    assert sched.req_to_token_pool.available_size() == sched.req_to_token_pool.size


def summary(body: dict[str, Any]) -> str:
    verifies = [a for step in body["accepted"] for _, a in step]
    return (f"{len(body['steps'])} steps, {sum(len(s[3]) for s in body['steps'])} retractions, "
            f"{len(body['aborted'])} aborted, {len(verifies)} verifies, mean accepted "
            f"{sum(verifies) / max(1, len(verifies)):.3f}")


def record_fixture(out: Path, name: str) -> Path:
    """Record workload `name` with the installed SGLang and write its fixture under `out`."""
    import sglang

    wall = time.monotonic()
    body = record(WORKLOADS[name])
    path = write_fixture(out, WORKLOADS[name], body, engine="sglang",
                         engine_version=sglang.__version__,
                         command=f"python tools/golden/record_sglang_spec.py --out {out} {name}")
    print(f"{name}: {summary(body)}, {time.monotonic() - wall:.0f} s -> {path}", flush=True)
    return path


def main() -> None:
    R.cli(__doc__ or "", __file__, WORKLOADS, record_fixture)


if __name__ == "__main__":
    main()

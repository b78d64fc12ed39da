"""Record golden schedules from the installed SGLang's own scheduler, on a CPU, on a virtual clock.

Run it in a separate environment that has SGLang (never servesim's: CI must not need it):

    /root/venv-sglang/bin/python tools/golden/record_sglang.py --out tests/golden [NAME ...]

How SGLang is driven (each workload in a fresh subprocess: SGLang publishes its server
arguments into a process-wide context):

* `sgl_kernel`'s CUDA ops cannot load without libcuda: `sgl_kernel/load_utils.py` is loaded by
  hand first and its `_load_architecture_specific_ops` made a no-op, then `sgl_kernel` imports.
  `SGLANG_USE_CPU_ENGINE=1` makes SGLang's `is_cpu()` true (its CPU code paths: native RoPE,
  torch allocations on the host); `HF_HUB_OFFLINE=1`.
* `ServerArgs(model_path=<temp dir with a one-layer Llama config.json>, device="cpu",
  load_format="dummy", skip_tokenizer_init=True, attention_backend="torch_native",
  disable_overlap_schedule (the workload's), disable_cuda_graph=True, dtype="float32",
  page_size=1, max_total_tokens=num_gpu_blocks, context_length=max_model_len, chunked_prefill_size,
  max_running_requests, disable_radix_cache, schedule_policy, random_seed=0)`, then, as
  `run_scheduler_process` does: `publish(server_args, role="scheduler", ranks=SpawnRanks(...))`
  and `Scheduler(server_args, PortArgs.init_new(server_args))` in this process. Its model
  runner, KV token pool (`max_total_num_tokens` = num_gpu_blocks; checked), req-to-token
  pool, radix cache / chunk cache, PrefillAdder and retraction are SGLang's own.
* Requests enter through `Scheduler.ingest_requests`, whose `request_receiver` is replaced by
  one returning `TokenizedGenerateReqInput`s (prompt ids from `workloads.prompt_token_ids`,
  `SamplingParams(max_new_tokens=output length, ignore_eos=settings.ignore_eos (default true),
  temperature=0)`, normalized
  and verified as the tokenizer manager does) for the requests whose `arrival_s <= now`.
* With disable_overlap_schedule true, the loop is `event_loop_normal`'s body, on a virtual
  clock: `ingest_requests`, `get_next_batch_to_run`, then `run_batch` + `process_batch_result`
  (the real forward pass of the one-layer dummy-weight model on the CPU, greedy sampling) or,
  with no batch, `on_idle` (which resets new_token_ratio when fully idle) and a jump to the
  next arrival.
* With disable_overlap_schedule false (SGLang's default), it is `event_loop_overlap`'s body,
  call for call (`_loop_overlap`): `ingest_requests`; `get_next_batch_to_run`;
  `is_disable_overlap_for_batch` (and its early `pop_and_process`); `run_batch` (overlap mode:
  the future map, `record_batch_in_overlap`), `_apply_war_barrier`, `result_queue.append(
  (batch.copy(), result))`; then `pop_and_process` of the previous batch (its
  `process_batch_result`) or, with neither batch, `on_idle`; `launch_batch_sample_if_needed`;
  `last_batch = batch`. `enable_skip_finishing_decode` is set as the loop sets it, so
  `_reqs_finishing_inflight` leaves out of a decode batch the requests whose queued result
  finishes them. Replaced: the request receiver, the clock (a queue of batch end times kept
  beside `result_queue`: `pop_and_process` first moves the clock to the end of the batch it
  pops), and the idle wait (no batch and none in flight: jump to the next arrival); left out:
  the `gracefully_exit` and `_engine_paused` branches (never taken here). Set first, as
  `run_event_loop` / `_dispatch_event_loop_once` do on a CPU: `enable_continuous_input_polling`
  off, `schedule_stream.synchronize` a no-op, `_war_barrier_enabled`, the schedule stream as
  the current stream, the loop under `DynamicGradMode`.
* The clock (as `record_vllm.py`'s async mode): a batch of n new tokens (the extend lengths of
  an extend batch, one per request of a decode batch) runs base_s + per_token_s * n, from
  max(the moment it is scheduled, the end of the batch before it); a batch's result is
  processed, and its tokens' times are, at its end; requests arrive (between iterations) when
  arrival_s <= now. In the normal loop a batch's result is processed before the next batch is
  scheduled, so each batch starts when it is scheduled; in the overlap loop batch k is
  scheduled right after batch k-1 is launched and batch k-2's result processed (at k-2's end,
  the start of k-1; after an idle spell, batch 2 at batch 1's launch), and runs from the end
  of batch k-1.

Recorded per step: [start_s, end_s, [[request id, tokens], ...] in the batch's order
(`batch.reqs`), [request ids retracted by `retract_decode`, or preempted by a higher priority
(`PrefillAdder.preempt_to_schedule`, each call's by request id), while this batch was built, in
that order]]; per request: [first_scheduled_s, first_token_s, finish_s, retractions]
(`Req.retraction_count`), first_token_s and finish_s the end of the step that produced them.
Nothing in the scheduler, memory pools or caches is replaced; only the request receiver (no
ZMQ) and the clock.

HiCache (`SGLANG_HICACHE_WORKLOADS`, recorded only when named: `settings.enable_hierarchical_cache`
with `hicache_ratio` and SGLang's other `--hicache-*` arguments in `HICACHE_SETTINGS`): the same
scheduler with a host KV pool as a second tier. `sglang_hicache.py` stands in for the
device <-> host copies, the pinning of the host pool and the copy streams' events; the tree,
host pool and controller are SGLang's. When a copy reads done is the workload's
`settings.hicache_transfer` ("next_batch": at the end of the first batch launched after it,
as on a GPU; "bandwidth": timed at `hicache_host_bandwidth_gb_s` as servesim times them, a
batch that carries a load-back then taking max(its step time, the load + its step time / 32),
and a copy the scheduler blocks on, write_back's at eviction, moving the clock to its end;
see `sglang_hicache.py`). A workload's `settings.temperature` (default 0, greedy) samples
instead (`torch.multinomial` from SGLang's generator, seeded by `random_seed` 0: SGLang's
per-request `sampling_seed` needs `--enable-deterministic-inference`), so outputs differ
per request and repeated prompts' outputs are not shared in the tree, as in real serving.
The fixture then also holds `hicache` (`HiCacheLog`): the host pool's size, the transfer
model (with "bandwidth", its rate, bytes a token and layers), and per step the load-backs
([request id, host hit, tokens loaded]), the tokens backed up to host, evicted from the device
(and of those, dropped with no host copy), evicted from host, the host pool's use and the
copies in flight.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
os.environ.setdefault("PYTHONHASHSEED", "0")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tools.golden.fixture import write_fixture  # noqa: E402
from tools.golden.workloads import Workload, prompt_token_ids  # noqa: E402
from tools.golden.workloads_sglang import (  # noqa: E402
    SGLANG_HICACHE_WORKLOADS,
    SGLANG_WORKLOADS,
)

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 4,
    "num_hidden_layers": 1, "vocab_size": 32000, "max_position_embeddings": 65536,
    "rms_norm_eps": 1e-5, "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2,
}


def model_config(workload: Workload) -> dict[str, Any]:
    """The model's config (`LLAMA_CONFIG`), without an EOS token for requests without
    ignore_eos (none set: transformers' LlamaConfig would default it to 2), so that each runs
    to its max_new_tokens, its output length (checked by the recorders)."""
    if workload["settings"].get("ignore_eos", True):
        return LLAMA_CONFIG
    return {**LLAMA_CONFIG, "eos_token_id": None}


def _stub_sgl_kernel_ops() -> None:
    """Import sgl_kernel without its CUDA ops library (there is no libcuda)."""
    if "sgl_kernel" in sys.modules:
        return
    spec = importlib.util.find_spec("sgl_kernel")
    assert spec is not None and spec.origin is not None
    path = Path(spec.origin).parent / "load_utils.py"
    load_spec = importlib.util.spec_from_file_location("sgl_kernel.load_utils", path)
    assert load_spec is not None and load_spec.loader is not None
    module = importlib.util.module_from_spec(load_spec)
    sys.modules["sgl_kernel.load_utils"] = module
    load_spec.loader.exec_module(module)
    module._load_architecture_specific_ops = lambda: None  # type: ignore[attr-defined]
    import sgl_kernel  # noqa: F401


def build_scheduler(workload: Workload, model_dir: str, **extra: Any) -> Any:
    """SGLang's Scheduler for the workload (`extra`: more server arguments; a setting in the
    workload's `unset` is left to SGLang, and the workload holds what SGLang resolves it
    to), checked to run with the workload's settings."""
    _stub_sgl_kernel_ops()
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.runtime_context import SpawnRanks, publish, spawn_world_rank
    from sglang.srt.server_args import PortArgs, ServerArgs

    s = workload["settings"]
    hicache = s.get("enable_hierarchical_cache", False)
    if hicache:  # (before the build: the HiCache modules' device module and copy kernels)
        from tools.golden import sglang_hicache

        sglang_hicache.install(s["hicache_transfer"], s.get("hicache_host_bandwidth_gb_s"))
    server_args = ServerArgs(
        model_path=model_dir, device="cpu", load_format="dummy", skip_tokenizer_init=True,
        attention_backend="torch_native",
        disable_overlap_schedule=s["disable_overlap_schedule"],
        disable_cuda_graph=True, dtype="float32", page_size=workload["block_size"],
        max_total_tokens=workload["num_gpu_blocks"], context_length=workload["max_model_len"],
        chunked_prefill_size=s["chunked_prefill_size"],
        max_running_requests=(None if "max_running_requests" in s.get("unset", ())
                              else s["max_running_requests"]),
        disable_radix_cache=s["disable_radix_cache"], schedule_policy=s["schedule_policy"],
        random_seed=0, **{k: s[k] for k in PRIORITY_SETTINGS + HICACHE_SETTINGS if k in s},
        **extra)
    port_args = PortArgs.init_new(server_args)
    publish(server_args, role="scheduler",
            ranks=SpawnRanks(world_rank=spawn_world_rank(server_args, tp_rank=0, pp_rank=0),
                             dp_rank=None, gpu_id=0))
    sched = Scheduler(server_args, port_args)
    # The pool is the size asked for, every slot usable, the cap as set.
    assert sched.max_total_num_tokens == workload["num_gpu_blocks"], sched.max_total_num_tokens
    assert (sched.token_to_kv_pool_allocator.available_size()
            == workload["num_gpu_blocks"]), sched.token_to_kv_pool_allocator.available_size()
    assert sched.max_running_requests == s["max_running_requests"], sched.max_running_requests
    assert sched.enable_overlap == (not s["disable_overlap_schedule"]), sched.enable_overlap
    assert sched.chunked_prefill_size == s["chunked_prefill_size"], sched.chunked_prefill_size
    assert bool(getattr(sched.tree_cache, "disable", True)) == s["disable_radix_cache"]
    assert sched.enable_priority_scheduling == s.get("enable_priority_scheduling", False)
    controller = getattr(sched.tree_cache, "cache_controller", None)
    assert (controller is not None) == hicache, controller
    if controller is not None:
        assert controller.write_policy == s.get("hicache_write_policy", "write_through")
    if sched.enable_priority_scheduling:
        assert sched.enable_priority_preemption == (not s.get("disable_priority_preemption"))
        assert sched.priority_scheduling_preemption_threshold == s.get(
            "priority_scheduling_preemption_threshold", 10)
    return sched


def make_request(workload: Workload, request_id: int) -> Any:
    from array import array

    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    _, _, num_output, _, _, *rest = workload["requests"][request_id]
    params = SamplingParams(max_new_tokens=num_output,
                            ignore_eos=workload["settings"].get("ignore_eos", True),
                            temperature=workload["settings"].get("temperature", 0.0))
    params.normalize(None)
    params.verify(LLAMA_CONFIG["vocab_size"])
    return TokenizedGenerateReqInput(
        rid=str(request_id), input_text=None,
        input_ids=array("q", prompt_token_ids(workload, request_id)), input_embeds=None,
        mm_inputs=None, token_type_ids=None, sampling_params=params, return_logprob=False,
        logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None, stream=False,
        **({"priority": int(rest[0])} if rest else {}))


# SGLang's priority scheduling arguments a workload may set (`--enable-priority-scheduling`...).
PRIORITY_SETTINGS = ("enable_priority_scheduling", "schedule_low_priority_values_first",
                     "priority_scheduling_preemption_threshold", "disable_priority_preemption")
# SGLang's HiCache arguments a workload may set (`--enable-hierarchical-cache`...); such a
# workload also sets `hicache_transfer`, the recorder's model of when a copy is done
# (`sglang_hicache.py`).
HICACHE_SETTINGS = ("enable_hierarchical_cache", "hicache_ratio", "hicache_write_policy",
                    "hicache_mem_layout")


class _Receiver:
    """Stands for the ZMQ receiver: hands over the requests that have arrived."""

    def __init__(self) -> None:
        self.pending: list[Any] = []

    def recv_requests(self, local_reqs: Any = None) -> list[Any]:
        out, self.pending = self.pending, []
        return list(local_reqs or []) + out


class _Recorder:
    """The virtual clock and what is recorded, shared by both loops."""

    def __init__(self, workload: Workload, sched: Any, receiver: _Receiver,
                 retracted: list[int]) -> None:
        self.workload, self.sched, self.receiver, self.retracted = (workload, sched, receiver,
                                                                    retracted)
        step = workload["step_time"]
        self.base_s, self.per_token_s = step["base_s"], step["per_token_s"]
        self.arrivals = workload["requests"]
        self.handles: dict[int, Any] = {}
        self.times: dict[int, dict[str, Any]] = {}
        self.steps: list[list[Any]] = []
        self.now_s = 0.0
        self.gpu_free_s = 0.0
        self.next_arrival = 0
        self._passed_again_s = -1.0  # the instant an idle pass with requests waiting passed again
        self._copy_pass_s = -1.0  # the last instant an idle pass was for a copy's end
        self.hicache: Any = None  # sglang_hicache.HiCacheLog with --enable-hierarchical-cache

    def launched(self, end_s: float) -> None:
        """A batch was just launched (recorded by `launch`), ending at `end_s`."""
        if self.hicache is not None:
            self.hicache.on_launch(end_s)

    def idle(self) -> None:
        """A pass launched nothing, and no batch is in flight."""
        if self.hicache is not None:
            self.hicache.on_idle()

    def add_arrived(self) -> None:
        arrivals = self.arrivals
        while (self.next_arrival < len(arrivals)
               and arrivals[self.next_arrival][0] <= self.now_s):
            rid = self.next_arrival
            self.receiver.pending.append(make_request(self.workload, rid))
            self.times[rid] = {"first_scheduled_s": None, "first_token_s": None,
                               "finish_s": None}
            self.next_arrival += 1

    def note_waiting(self) -> None:
        for req in self.sched.waiting_queue:
            self.handles.setdefault(int(req.rid), req)

    def launch(self, batch: Any) -> float:
        """Record `batch` as launched now; its end on the clock. It starts when it is
        scheduled or when the batch before it ends, whichever is later."""
        if batch.forward_mode.is_extend():
            scheduled = [[int(r.rid), int(n)] for r, n in zip(batch.reqs, batch.extend_lens,
                                                             strict=True)]
        else:
            assert batch.forward_mode.is_decode(), batch.forward_mode
            scheduled = [[int(r.rid), 1] for r in batch.reqs]
        total = sum(n for _, n in scheduled)
        start_s = max(self.now_s, self.gpu_free_s)
        forward_s = self.base_s + self.per_token_s * total
        if self.hicache is not None:  # (with "bandwidth", the loads it carries)
            forward_s = self.hicache.clock.duration_s(forward_s)
        end_s = start_s + forward_s
        self.gpu_free_s = end_s
        self.steps.append([start_s, end_s, scheduled, list(self.retracted)])
        for rid, _ in scheduled:
            if self.times[rid]["first_scheduled_s"] is None:
                self.times[rid]["first_scheduled_s"] = start_s
        return end_s

    def note_result(self, reqs: list[Any]) -> None:
        """A batch's result was just processed (at `now_s`, its end)."""
        for req in reqs:
            t = self.times[int(req.rid)]
            if t["first_token_s"] is None and len(req.output_ids) > 0:
                t["first_token_s"] = self.now_s
            if t["finish_s"] is None and req.finished():
                t["finish_s"] = self.now_s

    def wait_for_arrival(self) -> bool:
        """Nothing runs: jump to the next arrival; False when none is left. With requests
        waiting, SGLang's loop first passes again at once (a pass that scheduled nothing may
        have freed KV: speculative decoding's abort), once per instant. With HiCache copies
        timed ("bandwidth") and one pending, the loop polls on, and the next pass counted is
        when the next copy ends, if no arrival comes first (instead of the pass at once: as
        servesim, whose idle replica waits for the copy first; the passes of the spin
        between change nothing but SGLang's count of passes, `_waiting_prefix_refresh_calls`,
        which on a GPU depends on how fast the loop spins)."""
        sched = self.sched
        copy_s = self.hicache.next_copy_s() if self.hicache is not None else None
        if copy_s is not None and (self.next_arrival == len(self.arrivals)
                                   or copy_s <= self.arrivals[self.next_arrival][0]):
            assert copy_s > self._copy_pass_s, (copy_s, "a copy's ack not taken")
            self._copy_pass_s = self.now_s = max(self.now_s, copy_s)
            return True
        if sched.waiting_queue and self._passed_again_s != self.now_s:
            self._passed_again_s = self.now_s
            return True
        if self.next_arrival == len(self.arrivals):
            if sched.waiting_queue or not sched.running_batch.is_empty():
                raise RuntimeError(f"{self.workload['name']}: requests left, none can run")
            return False
        self.now_s = max(self.now_s, self.arrivals[self.next_arrival][0])
        return True


def _loop_normal(rec: _Recorder) -> None:
    """`event_loop_normal`'s body on the virtual clock (each batch's result is processed
    before the next is scheduled, so a batch starts when it is scheduled)."""
    sched = rec.sched
    while True:
        rec.add_arrived()
        del rec.retracted[:]
        sched.ingest_requests()
        rec.note_waiting()
        plan = sched.get_next_batch_to_run(running_batch=sched.running_batch,
                                           last_batch=sched.last_batch)
        sched.running_batch = plan.running_batch
        batch = plan.batch_to_run
        if batch:
            end_s = rec.launch(batch)
            rec.launched(end_s)
            result = sched.run_batch(batch)
            sched.process_batch_result(batch, result)
            rec.now_s = end_s
            rec.note_result(batch.reqs)
        else:
            assert not rec.retracted, rec.retracted
            sched.on_idle()
            rec.idle()
        sched.last_batch = batch
        if not batch and not rec.wait_for_arrival():
            break


def _loop_overlap(rec: _Recorder) -> None:
    """`event_loop_overlap`'s body, line for line, on the virtual clock.

    Replaced: the request receiver (`rec.add_arrived` before `ingest_requests`), the clock
    (`rec.launch` next to `run_batch`; `pop_and_process` first moves the clock to the end of
    the batch it pops, then notes its requests' token times), and the idle wait (with no
    batch and no batch in flight, jump to the next arrival). Left out: the
    `gracefully_exit` / `_engine_paused` branches (never taken here). As
    `run_event_loop` and `_dispatch_event_loop_once` do first: input polling off, the CPU
    schedule stream's `synchronize` a no-op, the WAR barrier flag, the schedule stream as
    the current stream; `event_loop_overlap` itself then sets
    `enable_skip_finishing_decode` and the `result_queue`."""
    from sglang.srt.environ import envs
    from sglang.srt.managers.scheduler import is_cuda
    from sglang.srt.utils.common import DynamicGradMode

    sched = rec.sched
    # run_event_loop / _dispatch_event_loop_once
    sched.enable_continuous_input_polling = False
    sched.enable_skip_finishing_decode = False
    assert sched.device == "cpu"
    sched.schedule_stream.synchronize = lambda: None  # No-op for CPU
    sched._war_barrier_enabled = is_cuda() or envs.SGLANG_ENABLE_WAR_BARRIER.get()
    # event_loop_overlap
    sched.enable_skip_finishing_decode = True
    sched.result_queue = deque()
    in_flight: deque[tuple[float, list[Any]]] = deque()  # (end_s, reqs), as result_queue

    def pop_and_process() -> None:
        # Process the results of the last batch
        tmp_batch, tmp_result = sched.result_queue.popleft()
        end_s, reqs = in_flight.popleft()
        rec.now_s = max(rec.now_s, end_s)
        sched.process_batch_result(tmp_batch, tmp_result)
        rec.note_result(reqs)

    @DynamicGradMode()
    def loop() -> None:
        while True:
            assert len(in_flight) == len(sched.result_queue)
            # Receive requests
            rec.add_arrived()
            del rec.retracted[:]
            sched.ingest_requests()
            rec.note_waiting()
            assert not sched._engine_paused

            # Get the next batch to run
            plan = sched.get_next_batch_to_run(running_batch=sched.running_batch,
                                               last_batch=sched.last_batch)
            sched.running_batch = plan.running_batch
            batch = plan.batch_to_run
            sched.cur_batch_for_debug = batch
            disable_overlap_for_batch = sched.is_disable_overlap_for_batch(
                batch, last_batch=sched.last_batch)

            # If we do not need to overlap the current batch with the last batch,
            # we can process the last batch immediately.
            if disable_overlap_for_batch:
                pop_and_process()
                if sched.enable_unified_memory:
                    with contextlib.suppress(Exception):
                        sched.token_to_kv_pool_allocator.flush_opportunistic()

            # Launch the current batch
            if batch:
                end_s = rec.launch(batch)
                rec.launched(end_s)
                reqs = list(batch.reqs)
                batch_result = sched.run_batch(batch)
                sched._apply_war_barrier()
                sched.result_queue.append((batch.copy(), batch_result))
                in_flight.append((end_s, reqs))
            else:
                assert not rec.retracted, rec.retracted
                batch_result = None
                sched._sched_idled = True

            # Process the last batch
            if sched.last_batch:
                if not disable_overlap_for_batch:
                    pop_and_process()
            elif batch is None:
                # When the server is idle, do self-check and re-init some states
                sched.on_idle()

            # Run sample of the current batch
            if sched.is_generation:
                sched.launch_batch_sample_if_needed(batch_result, batch)

            # Update last_batch
            was_idle = batch is None and sched.last_batch is None
            sched.last_batch = batch

            if envs.SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY.get():
                sched.invariant_checker.self_check_during_busy()

            if was_idle:
                assert not sched.result_queue
                rec.idle()
                if not rec.wait_for_arrival():
                    break

    with sched.device_module.StreamContext(sched.schedule_stream):
        loop()


def record(workload: Workload) -> dict[str, Any]:
    """Drive SGLang's scheduler through `workload`; the fixture's body (see `fixture.py`)."""
    ignore_eos = workload["settings"].get("ignore_eos", True)
    with tempfile.TemporaryDirectory() as model_dir:
        Path(model_dir, "config.json").write_text(json.dumps(model_config(workload)))
        sched = build_scheduler(workload, model_dir)
    assert ignore_eos or not sched.model_config.hf_eos_token_id, sched.model_config.hf_eos_token_id
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    retracted: list[int] = []
    original_retract = ScheduleBatch.retract_decode

    def retract_decode(self: Any) -> Any:
        out = original_retract(self)
        retracted.extend(int(r.rid) for r in out[0])
        assert not out[2], "requests aborted by retract_decode"
        return out

    ScheduleBatch.retract_decode = retract_decode  # type: ignore[method-assign]
    from sglang.srt.managers.schedule_policy import PrefillAdder

    original_preempt = PrefillAdder.preempt_to_schedule

    def preempt_to_schedule(self: Any, req: Any) -> Any:
        before = len(self.preempt_list)
        out = original_preempt(self, req)
        # (One call's victims by request id: SGLang extends its list from a set.)
        retracted.extend(sorted(int(r.rid) for r in self.preempt_list[before:]))
        return out

    PrefillAdder.preempt_to_schedule = preempt_to_schedule  # type: ignore[method-assign]
    receiver = _Receiver()
    sched.request_receiver = receiver
    rec = _Recorder(workload, sched, receiver, retracted)
    if workload["settings"].get("enable_hierarchical_cache"):
        from tools.golden import sglang_hicache

        assert sglang_hicache.CLOCK is not None
        rec.hicache = sglang_hicache.HiCacheLog(sched, sglang_hicache.CLOCK, rec)
    wall = time.monotonic()
    if workload["settings"]["disable_overlap_schedule"]:
        _loop_normal(rec)
    else:
        _loop_overlap(rec)
    times, handles, arrivals = rec.times, rec.handles, rec.arrivals
    unfinished = [rid for rid, t in times.items() if t["finish_s"] is None]
    assert not unfinished and len(times) == len(arrivals), unfinished[:5]
    assert len(handles) == len(arrivals), len(handles)
    for rid, req in handles.items():
        assert len(req.output_ids) == arrivals[rid][2], (rid, len(req.output_ids))
        assert req.sampling_params.ignore_eos == ignore_eos
    print(f"{workload['name']}: {len(rec.steps)} steps in {time.monotonic() - wall:.0f} s",
          file=sys.stderr)
    body: dict[str, Any] = {
        "steps": rec.steps,
        "requests": [[times[r]["first_scheduled_s"], times[r]["first_token_s"],
                      times[r]["finish_s"], int(handles[r].retraction_count)]
                     for r in range(len(arrivals))]}
    if rec.hicache is not None:
        body["hicache"] = rec.hicache.body()
        assert len(body["hicache"]["steps"]) == len(rec.steps)
    return body


def record_fixture(out: Path, workload: Workload, command: str) -> None:
    """Record `workload` with the installed SGLang and write its fixture under `out`."""
    import sglang

    body = record(workload)
    path = write_fixture(out, workload, body, engine="sglang", engine_version=sglang.__version__,
                         command=command)
    print(f"{workload['name']}: {len(body['steps'])} steps -> {path}", flush=True)


def _record_one(out: Path, name: str) -> None:
    record_fixture(out, {**SGLANG_WORKLOADS, **SGLANG_HICACHE_WORKLOADS}[name],
                   f"python tools/golden/record_sglang.py --out {out} {name}")


def cli(doc: str, script: str, workloads: Iterable[str],
        record_one: Callable[[Path, str], Any], named_only: Iterable[str] = ()) -> None:
    """A recorder's command line: `--out DIR [NAME ...]` records the workloads named (default:
    all of `workloads`; those of `named_only` only when named), each in a fresh process of
    `script` (SGLang's server-args context is process-wide) that calls `record_one(out, name)`."""
    default = list(workloads)
    known = default + list(named_only)
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--in-process", action="store_true",
                        help="record one workload in this process (used per workload)")
    parser.add_argument("names", nargs="*",
                        help="workloads (default: all but " + (", ".join(named_only) or "none")
                        + ")")
    args = parser.parse_args()
    names = args.names or default
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown workloads: {unknown}")
    if args.in_process:
        assert len(names) == 1, "--in-process records one workload"
        record_one(args.out, names[0])
        return
    for name in names:
        subprocess.run([sys.executable, script, "--out", str(args.out), "--in-process", name],
                       check=True)


def main() -> None:
    # (The HiCache workloads only when named: servesim does not model HiCache yet.)
    cli(__doc__ or "", __file__, SGLANG_WORKLOADS, _record_one,
        named_only=SGLANG_HICACHE_WORKLOADS)


if __name__ == "__main__":
    main()

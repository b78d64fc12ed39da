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
  disable_overlap_schedule=True, disable_cuda_graph=True, dtype="float32", page_size=1,
  max_total_tokens=num_gpu_blocks, context_length=max_model_len, chunked_prefill_size,
  max_running_requests, disable_radix_cache, schedule_policy, random_seed=0)`, then, as
  `run_scheduler_process` does: `publish(server_args, role="scheduler", ranks=SpawnRanks(...))`
  and `Scheduler(server_args, PortArgs.init_new(server_args))` in this process. Its model
  runner, KV token pool (`max_total_num_tokens` = num_gpu_blocks; checked), req-to-token
  pool, radix cache / chunk cache, PrefillAdder and retraction are SGLang's own.
* Requests enter through `Scheduler.ingest_requests`, whose `request_receiver` is replaced by
  one returning `TokenizedGenerateReqInput`s (prompt ids from `workloads.prompt_token_ids`,
  `SamplingParams(max_new_tokens=output length, ignore_eos=True, temperature=0)`, normalized
  and verified as the tokenizer manager does) for the requests whose `arrival_s <= now`.
* The loop is `event_loop_normal`'s body, on a virtual clock: `ingest_requests`,
  `get_next_batch_to_run`, then `run_batch` + `process_batch_result` (the real forward pass of
  the one-layer dummy-weight model on the CPU, greedy sampling) or, with no batch, `on_idle`
  (which resets new_token_ratio when fully idle) and a jump to the next arrival. A batch of n
  new tokens (the extend lengths of an extend batch, one per request of a decode batch) runs
  base_s + per_token_s * n, from the moment it is scheduled.

Recorded per step: [start_s, end_s, [[request id, tokens], ...] in the batch's order
(`batch.reqs`), [request ids retracted by `retract_decode` while this batch was built, in
retraction order]]; per request: [first_scheduled_s, first_token_s, finish_s, retractions]
(`Req.retraction_count`), first_token_s and finish_s the end of the step that produced them.
Nothing in the scheduler, memory pools or caches is replaced; only the request receiver (no
ZMQ) and the clock.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
os.environ.setdefault("PYTHONHASHSEED", "0")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tools.golden.fixture import write_fixture  # noqa: E402
from tools.golden.workloads import Workload, prompt_token_ids  # noqa: E402
from tools.golden.workloads_sglang import SGLANG_WORKLOADS  # noqa: E402

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 4,
    "num_hidden_layers": 1, "vocab_size": 32000, "max_position_embeddings": 65536,
    "rms_norm_eps": 1e-5, "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2,
}


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


def build_scheduler(workload: Workload, model_dir: str) -> Any:
    _stub_sgl_kernel_ops()
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.runtime_context import SpawnRanks, publish, spawn_world_rank
    from sglang.srt.server_args import PortArgs, ServerArgs

    s = workload["settings"]
    server_args = ServerArgs(
        model_path=model_dir, device="cpu", load_format="dummy", skip_tokenizer_init=True,
        attention_backend="torch_native", disable_overlap_schedule=True,
        disable_cuda_graph=True, dtype="float32", page_size=workload["block_size"],
        max_total_tokens=workload["num_gpu_blocks"], context_length=workload["max_model_len"],
        chunked_prefill_size=s["chunked_prefill_size"],
        max_running_requests=s["max_running_requests"],
        disable_radix_cache=s["disable_radix_cache"], schedule_policy=s["schedule_policy"],
        random_seed=0)
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
    assert sched.chunked_prefill_size == s["chunked_prefill_size"], sched.chunked_prefill_size
    assert bool(getattr(sched.tree_cache, "disable", True)) == s["disable_radix_cache"]
    return sched


def make_request(workload: Workload, request_id: int) -> Any:
    from array import array

    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    _, _, num_output, _, _ = workload["requests"][request_id]
    params = SamplingParams(max_new_tokens=num_output, ignore_eos=True, temperature=0.0)
    params.normalize(None)
    params.verify(LLAMA_CONFIG["vocab_size"])
    return TokenizedGenerateReqInput(
        rid=str(request_id), input_text=None,
        input_ids=array("q", prompt_token_ids(workload, request_id)), input_embeds=None,
        mm_inputs=None, token_type_ids=None, sampling_params=params, return_logprob=False,
        logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None, stream=False)


class _Receiver:
    """Stands for the ZMQ receiver: hands over the requests that have arrived."""

    def __init__(self) -> None:
        self.pending: list[Any] = []

    def recv_requests(self, local_reqs: Any = None) -> list[Any]:
        out, self.pending = self.pending, []
        return list(local_reqs or []) + out


def record(workload: Workload) -> dict[str, Any]:
    """Drive SGLang's scheduler through `workload`; the fixture's body (see `fixture.py`)."""
    with tempfile.TemporaryDirectory() as model_dir:
        Path(model_dir, "config.json").write_text(json.dumps(LLAMA_CONFIG))
        sched = build_scheduler(workload, model_dir)
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    retracted: list[int] = []
    original_retract = ScheduleBatch.retract_decode

    def retract_decode(self: Any) -> Any:
        out = original_retract(self)
        retracted.extend(int(r.rid) for r in out[0])
        assert not out[2], "requests aborted by retract_decode"
        return out

    ScheduleBatch.retract_decode = retract_decode  # type: ignore[method-assign]
    receiver = _Receiver()
    sched.request_receiver = receiver

    step = workload["step_time"]
    base_s, per_token_s = step["base_s"], step["per_token_s"]
    arrivals = workload["requests"]
    handles: dict[int, Any] = {}
    times: dict[int, dict[str, Any]] = {}
    steps: list[list[Any]] = []
    now_s = 0.0
    next_arrival = 0
    wall = time.monotonic()

    def add_arrived() -> None:
        nonlocal next_arrival
        while next_arrival < len(arrivals) and arrivals[next_arrival][0] <= now_s:
            rid = next_arrival
            receiver.pending.append(make_request(workload, rid))
            times[rid] = {"first_scheduled_s": None, "first_token_s": None, "finish_s": None}
            next_arrival += 1

    while True:
        add_arrived()
        del retracted[:]
        sched.ingest_requests()
        for req in sched.waiting_queue:
            handles.setdefault(int(req.rid), req)
        plan = sched.get_next_batch_to_run(running_batch=sched.running_batch,
                                           last_batch=sched.last_batch)
        sched.running_batch = plan.running_batch
        batch = plan.batch_to_run
        if batch:
            if batch.forward_mode.is_extend():
                scheduled = [[int(r.rid), int(n)] for r, n in zip(batch.reqs, batch.extend_lens,
                                                                 strict=True)]
            else:
                assert batch.forward_mode.is_decode(), batch.forward_mode
                scheduled = [[int(r.rid), 1] for r in batch.reqs]
            total = sum(n for _, n in scheduled)
            start_s = now_s
            end_s = start_s + (base_s + per_token_s * total)
            steps.append([start_s, end_s, scheduled, list(retracted)])
            for rid, _ in scheduled:
                if times[rid]["first_scheduled_s"] is None:
                    times[rid]["first_scheduled_s"] = start_s
            result = sched.run_batch(batch)
            sched.process_batch_result(batch, result)
            now_s = end_s
            for req in batch.reqs:
                t = times[int(req.rid)]
                if t["first_token_s"] is None and len(req.output_ids) > 0:
                    t["first_token_s"] = now_s
                if t["finish_s"] is None and req.finished():
                    t["finish_s"] = now_s
        else:
            assert not retracted, retracted
            sched.on_idle()
        sched.last_batch = batch
        if not batch:
            if next_arrival == len(arrivals):
                if sched.waiting_queue or not sched.running_batch.is_empty():
                    raise RuntimeError(f"{workload['name']}: requests left, none can run")
                break
            now_s = max(now_s, arrivals[next_arrival][0])
    unfinished = [rid for rid, t in times.items() if t["finish_s"] is None]
    assert not unfinished and len(times) == len(arrivals), unfinished[:5]
    for rid, req in handles.items():
        assert len(req.output_ids) == arrivals[rid][2], (rid, len(req.output_ids))
    print(f"{workload['name']}: {len(steps)} steps in {time.monotonic() - wall:.0f} s",
          file=sys.stderr)
    return {"steps": steps,
            "requests": [[times[r]["first_scheduled_s"], times[r]["first_token_s"],
                          times[r]["finish_s"], int(handles[r].retraction_count)]
                         for r in range(len(arrivals))]}


def _record_one(out: Path, name: str) -> None:
    import sglang

    workload = SGLANG_WORKLOADS[name]
    body = record(workload)
    path = write_fixture(out, workload, body, engine="sglang", engine_version=sglang.__version__,
                         command=f"python tools/golden/record_sglang.py --out {out} {name}")
    print(f"{name}: {len(body['steps'])} steps -> {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--in-process", action="store_true",
                        help="record one workload in this process (used per workload)")
    parser.add_argument("names", nargs="*", help="workloads (default: all)")
    args = parser.parse_args()
    names = args.names or list(SGLANG_WORKLOADS)
    unknown = [n for n in names if n not in SGLANG_WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads: {unknown}")
    if args.in_process:
        assert len(names) == 1, "--in-process records one workload"
        _record_one(args.out, names[0])
        return
    for name in names:  # a fresh process each: SGLang's server-args context is process-wide
        subprocess.run([sys.executable, __file__, "--out", str(args.out), "--in-process", name],
                       check=True)


if __name__ == "__main__":
    main()

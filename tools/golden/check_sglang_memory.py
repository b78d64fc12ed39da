"""SGLang 0.5.23's default `--mem-fraction-static` for a GPU's memory, TP, PP and pool, read from
SGLang's own server-argument resolution on a CPU, for `tests/schedulers/test_sglang_memory.py`
(which holds what this printed) and `sim.schedulers.sglang_memory`.

    python3 tools/golden/check_sglang_memory.py        # drives ~/venv-sglang, one process a case

Each case builds SGLang's `ServerArgs` in a fresh process for a Llama-3.1-8B-shaped config
(`--context-length` 131072) and resolves it (`resolve_once`) with the device's memory
(`get_device_memory_capacity`, nvidia-smi's total in MiB) replaced by the case's. On a CPU
SGLang takes its decode graphs' batch limit from `--torch-compile-max-bs` (given as unset, so
the limit by the GPU's memory stands) and leaves prefill CUDA graphs off: the case turns the
"breakable" prefill graphs on where SGLang does on CUDA (no pipeline), and prints the
`mem_fraction_static` the hook resolved.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SGLANG_PYTHON = Path.home() / "venv-sglang" / "bin" / "python"
# (GPU MiB as nvidia-smi prints it, TP, PP, more server arguments)
CASES: list[tuple[int, int, int, dict[str, Any]]] = [
    (81_559, 1, 1, {}),  # H100 80GB
    (81_559, 4, 1, {}),
    (81_559, 1, 2, {}),
    (81_559, 1, 1, {"max_running_requests": 64}),
    (81_559, 1, 1, {"chunked_prefill_size": 16384}),
    (143_771, 1, 1, {}),  # H200
    (143_771, 8, 1, {}),
    (81_920, 2, 1, {}),  # A100 80GB
    (46_068, 1, 1, {}),  # L40S
    (24_564, 1, 1, {}),  # RTX 4090
    (23_028, 4, 1, {}),  # A10G
    (183_359, 1, 1, {}),  # B200
    (97_887, 1, 1, {}),  # RTX PRO 6000
    (81_559, 1, 1, {"disaggregation_mode": "prefill"}),
    (81_559, 1, 1, {"disaggregation_mode": "decode"}),
    # DP attention (`--tp T --dp D --enable-dp-attention`: servesim's data D x tensor T / D)
    (143_771, 8, 1, {"enable_dp_attention": True, "dp_size": 8}),
    (81_559, 4, 1, {"enable_dp_attention": True, "dp_size": 4}),
    (81_559, 8, 1, {"enable_dp_attention": True, "dp_size": 8, "max_running_requests": 64}),
    (143_771, 8, 1, {"enable_dp_attention": True, "dp_size": 8,
                     "disaggregation_mode": "decode"}),
    (143_771, 8, 1, {"enable_dp_attention": True, "dp_size": 8,
                     "disaggregation_mode": "prefill"}),
    (143_771, 8, 1, {"enable_dp_attention": True, "dp_size": 2}),
]
LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
            "num_hidden_layers": 32, "vocab_size": 128256, "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "bos_token_id": 1,
            "eos_token_id": 2}


def resolve(gpu_mib: int, tp: int, pp: int, extra: dict[str, Any]) -> float:
    """In the SGLang venv: the resolved `mem_fraction_static`."""
    from tools.golden.record_sglang import _stub_sgl_kernel_ops

    _stub_sgl_kernel_ops()
    import sglang.srt.arg_groups.memory_hook as memory_hook
    from sglang.srt.server_args import ServerArgs

    memory_hook.get_device_memory_capacity = lambda device=None: float(gpu_mib)
    with tempfile.TemporaryDirectory() as model_dir:
        Path(model_dir, "config.json").write_text(json.dumps(LLAMA_8B))
        prefill_graphs = ({"cuda_graph_backend_prefill": "breakable"}
                          if pp == 1 and extra.get("disaggregation_mode") != "decode" else {})
        args = ServerArgs(model_path=model_dir, device="cpu", load_format="dummy",
                          skip_tokenizer_init=True, tp_size=tp, pp_size=pp,
                          torch_compile_max_bs=None, **prefill_graphs, **extra)
        args.resolve_once()
    fractions = [fields["mem_fraction_static"] for _, fields in args._resolved_overrides
                 if "mem_fraction_static" in fields]
    if extra.get("enable_dp_attention"):
        # What DP attention changed (`handle_data_parallelism`): each rank's chunk, the
        # conservativeness, the graphs' largest sizes (`sim.schedulers.sglang_config.for_rank`,
        # `sim.engine.data_parallel`).
        last = {key: value for _, fields in args._resolved_overrides
                for key, value in fields.items()}
        graphs = last["cuda_graph_config"]
        print("DP", json.dumps({"chunked_prefill_size": last["chunked_prefill_size"],
                                "schedule_conservativeness": last["schedule_conservativeness"],
                                "prefill_graph_max_bs": graphs.prefill.max_bs,
                                "decode_graph_max_bs": graphs.decode.max_bs}))
    return float(fractions[-1])


def main() -> None:
    if len(sys.argv) == 2:
        gpu_mib, tp, pp, extra = json.loads(sys.argv[1])
        print("RESOLVED", resolve(gpu_mib, tp, pp, extra))
        return
    for case in CASES:
        out = subprocess.run([str(SGLANG_PYTHON), __file__, json.dumps(case)],
                             capture_output=True, text=True, check=False)
        lines = [line for line in out.stdout.splitlines() if line.startswith("RESOLVED")]
        print(case, lines[-1].split()[1] if lines else out.stderr[-2000:], flush=True)
        for line in out.stdout.splitlines():
            if line.startswith("DP "):
                print("   ", line[3:], flush=True)


if __name__ == "__main__":
    main()

"""Check `tools/golden/sglang_cpu_ops.py` against SGLang's own kernels: each torch stand-in and
the Triton kernel it stands for (run by Triton's interpreter on the CPU, `TRITON_INTERPRET=1`)
get the same random inputs, and every output must be equal. The KV-row move
(`copy_all_layer_kv_cache_cpu`, whose kernel casts raw addresses, which the interpreter does
not) is checked against the same move done with tensor indexing.

    /root/venv-sglang/bin/python tools/golden/check_sglang_cpu_ops.py [--trials 40]

Prints one line per op and exits 1 if any output differs. Runs in the SGLang venv (about a
minute: the interpreter is slow).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from collections import Counter
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
os.environ["SGLANG_USE_CPU_ENGINE"] = "0"  # SGLang imports its Triton kernels, not the CPU ops
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from tools.golden.record_sglang import _stub_sgl_kernel_ops  # noqa: E402

_stub_sgl_kernel_ops()
from tools.golden import sglang_cpu_ops  # noqa: E402,F401  (registers the ops)

OPS = torch.ops.sgl_kernel
FAILED: Counter[str] = Counter()
CHECKED: Counter[str] = Counter()


def same(name: str, ours: tuple[torch.Tensor, ...], theirs: tuple[torch.Tensor, ...]) -> None:
    CHECKED[name] += 1
    if not all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)):
        FAILED[name] += 1


def check_slot_tables(rng: random.Random) -> None:
    from sglang.kernels.ops.speculative import cache_locs
    from sglang.srt.mem_cache import allocation

    rows, pool_len = 8, 64
    bs = rng.randint(1, 6)
    rpi = torch.tensor(rng.sample(range(rows), bs), dtype=torch.int64)
    start = torch.tensor([rng.randint(0, 30) for _ in range(bs)], dtype=torch.int64)
    end = start + torch.tensor([rng.randint(0, 12) for _ in range(bs)], dtype=torch.int64)
    total = int((end - start).sum())
    locs = torch.randint(0, 10_000, (total,), dtype=torch.int64)
    table = torch.randint(0, 10_000, (rows, pool_len), dtype=torch.int32)
    upper = 8  # next_power_of_2(bs) for bs <= 8

    ours, theirs = table.clone(), table.clone()
    OPS.assign_req_to_token_pool_cpu(rpi, ours, start, end, locs, pool_len)
    allocation.assign_req_to_token_pool[(bs,)](rpi, theirs, start, end, locs, pool_len, upper)
    same("assign_req_to_token_pool_cpu", (ours,), (theirs,))

    ours, theirs = torch.zeros(total, dtype=torch.int64), torch.zeros(total, dtype=torch.int64)
    OPS.assign_extend_cache_locs_cpu(rpi, table, start, end, ours, pool_len)
    cache_locs.assign_extend_cache_locs[(bs,)](rpi, table, start, end, theirs, pool_len, upper)
    same("assign_extend_cache_locs_cpu", (ours,), (theirs,))

    topk, steps = rng.randint(1, 3), rng.randint(1, 5)
    seq = torch.tensor([rng.randint(0, 40) for _ in range(bs)], dtype=torch.int64)
    ours = torch.zeros(bs * topk * steps, dtype=torch.int64)
    theirs = ours.clone()
    OPS.assign_draft_cache_locs_contiguous_cpu(rpi, table, seq, ours, pool_len, topk, steps)
    cache_locs.assign_draft_cache_locs_contiguous[(bs,)](rpi, table, seq, theirs, pool_len,
                                                         topk, steps)
    same("assign_draft_cache_locs_contiguous_cpu", (ours,), (theirs,))


def check_accept_outputs(rng: random.Random) -> None:
    from sglang.kernels.ops.speculative import eagle

    bs, stride = rng.randint(1, 6), rng.randint(2, 6)
    tokens = torch.randint(0, 100, (bs * stride,), dtype=torch.int32)
    lens = torch.tensor([rng.randint(1, stride) for _ in range(bs)], dtype=torch.int32)
    ours, theirs = torch.zeros(bs, dtype=torch.int32), torch.zeros(bs, dtype=torch.int32)
    OPS.fill_bonus_tokens_cpu(tokens, lens, ours, stride)
    eagle.fill_bonus_tokens[(bs,)](tokens, lens, theirs, stride)
    same("fill_bonus_tokens_cpu", (ours,), (theirs,))

    size = bs * stride
    index = torch.tensor([rng.choice([-1, rng.randint(0, 29)]) for _ in range(size)],
                         dtype=torch.int32)
    locs = torch.randint(0, 1000, (30,), dtype=torch.int64)
    ours, theirs = torch.zeros(size, dtype=torch.int64), torch.zeros(size, dtype=torch.int64)
    OPS.fill_accept_out_cache_loc_cpu(index, locs, ours)
    upper = 1 << (size - 1).bit_length()
    eagle.fill_accept_out_cache_loc[(size,)](index, locs, theirs, upper)
    same("fill_accept_out_cache_loc_cpu", (ours,), (theirs,))


def _eagle_choice(rng: random.Random, bs: int, topk: int, depth: int, n: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """What EAGLE's draft passes hand the tree builder: per request the n - 1 selected
    candidates (sorted indices into topk + (depth - 1) * topk**2 candidates) and the parent
    list (-1, then topk * (depth - 1) candidate indices); for topk 1 the chain."""
    if topk == 1:
        selected = torch.arange(n - 1).repeat(bs, 1)
        parents = torch.cat([torch.full((bs, 1), -1), torch.arange(depth - 1).repeat(bs, 1)], 1)
        return parents, selected
    num_cand = topk + (depth - 1) * topk * topk
    selected = torch.stack([torch.tensor(sorted(rng.sample(range(num_cand), n - 1)))
                            for _ in range(bs)])
    parents = torch.stack([torch.tensor([-1] + sorted(rng.sample(range(num_cand),
                                                                 topk * (depth - 1))))
                           for _ in range(bs)])
    return parents, selected


def check_tree(rng: random.Random) -> None:
    from sglang.kernels.ops.speculative import spec_tree

    bs = rng.randint(1, 5)
    topk, depth = rng.choice([(1, 3), (1, 5), (2, 3), (4, 5), (3, 2)])
    n = depth + 1 if topk == 1 else rng.randint(2, min(8, topk + (depth - 1) * topk * topk + 1))
    parents, selected = _eagle_choice(rng, bs, topk, depth, n)
    seq = torch.tensor([rng.randint(1, 30) for _ in range(bs)], dtype=torch.int64)
    mode = rng.choice([0, 1])
    mask_size = (int(seq.sum()) * n + n * n * bs) if mode == 0 else n * n * bs
    built = []
    for impl in ("ours", "theirs"):
        mask = torch.full((mask_size,), True)  # the sequence's columns are left as they are
        pos = torch.zeros(bs * n, dtype=torch.int64)
        index = torch.full((bs, n), -1, dtype=torch.int64)
        nxt, sib = index.clone(), index.clone()
        args = (parents, selected, seq, mask, pos, index, nxt, sib, topk, depth, n, mode)
        if impl == "ours":
            OPS.build_tree_kernel_efficient_cpu(*args)
        else:
            spec_tree.sgl_build_tree_kernel_triton(*args)
        built.append((mask, pos, index, nxt, sib))
    same("build_tree_kernel_efficient_cpu", built[0], built[1])

    _, _, index, nxt, sib = built[0]
    # Few distinct tokens, so that paths match often.
    candidates = torch.randint(0, 3, (bs, n))
    target = torch.randint(0, 3, (bs, n))
    levels = rng.randint(2, depth + 1)
    verified = []
    for impl in ("ours", "theirs"):
        predicts = torch.zeros(bs * n, dtype=torch.int32)
        accept_index = torch.full((bs, levels), -1, dtype=torch.int32)
        accepted = torch.zeros(bs, dtype=torch.int32)
        walk = (predicts, accept_index, accepted, candidates, index, nxt, sib, target)
        if impl == "ours":
            OPS.verify_tree_greedy_cpu(*walk)
        else:
            spec_tree.verify_tree_greedy_triton(*walk)
        verified.append((predicts, accept_index, accepted))
    same("verify_tree_greedy_cpu", verified[0], verified[1])


def check_reconstruct(rng: random.Random) -> None:
    from sglang.kernels.ops.speculative import reconstruct_tree

    bs, n = rng.randint(1, 5), rng.randint(2, 12)
    mask = torch.zeros(bs, n, n, dtype=torch.bool)
    for b in range(bs):
        parent = [-1] + [rng.randint(0, i - 1) for i in range(1, n)]
        for i in range(n):
            j = i
            while j != -1:
                mask[b, i, j] = True
                j = parent[j]
    seq = torch.tensor([rng.randint(1, 30) for _ in range(bs)], dtype=torch.int64)
    out = []
    for impl in ("ours", "theirs"):
        pos, index, nxt, sib = (torch.zeros(bs * n, dtype=torch.int64) for _ in range(4))
        args = (mask.flatten(), seq, pos, index, nxt, sib, bs, n)
        if impl == "ours":
            OPS.reconstruct_indices_from_tree_mask_cpu(*args)
        else:
            reconstruct_tree.reconstruct_indices_from_tree_mask_triton(*args)
        out.append((pos, index, nxt, sib))
    same("reconstruct_indices_from_tree_mask_cpu", out[0], out[1])


def check_kv_move(rng: random.Random) -> None:
    layers = [torch.randn(20, rng.choice([3, 8, 16])) for _ in range(3)]
    expected = [t.clone() for t in layers]
    num = rng.randint(1, 8)
    src = torch.tensor(rng.sample(range(20), num))
    tgt = torch.tensor(rng.sample(range(20), num))  # may overlap src: all read, then written
    for t in expected:
        t[tgt] = t[src].clone()
    ptrs = torch.tensor([t.data_ptr() for t in layers], dtype=torch.uint64)
    strides = torch.tensor([t.stride(0) * t.element_size() for t in layers], dtype=torch.int64)
    OPS.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    same("copy_all_layer_kv_cache_cpu", tuple(layers), tuple(expected))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=40)
    args = parser.parse_args()
    rng = random.Random(0)
    torch.manual_seed(0)
    for _ in range(args.trials):
        check_slot_tables(rng)
        check_accept_outputs(rng)
        check_tree(rng)
        check_reconstruct(rng)
        check_kv_move(rng)
    for name in sglang_cpu_ops.REGISTERED:
        print(f"{name}: {CHECKED[name]} checks, {FAILED[name]} differ")
    missing = set(sglang_cpu_ops.REGISTERED) - set(CHECKED)
    assert not missing, missing
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())

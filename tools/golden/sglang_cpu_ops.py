"""Pure-torch stand-ins for the `sgl_kernel` CPU ops SGLang 0.5.23's speculative decoding calls
on `device="cpu"` (used by `tools/golden/record_sglang_spec.py`).

On a CPU, SGLang calls `torch.ops.sgl_kernel.<name>_cpu` for the index bookkeeping of
speculative decoding. Only the sgl-kernel CPU build (Intel AMX, compiled from source) has those
ops; the PyPI `sglang-kernel` wheel has none of them. Importing this module registers, for each
op, a plain-Python implementation of what the GPU's Triton kernel of the same name computes:

    op (torch.ops.sgl_kernel.*)              stands for (SGLang 0.5.23, sglang/...)
    assign_req_to_token_pool_cpu             srt/mem_cache/allocation.py assign_req_to_token_pool
    assign_extend_cache_locs_cpu             kernels/ops/speculative/cache_locs.py
                                             assign_extend_cache_locs
    assign_draft_cache_locs_contiguous_cpu   kernels/ops/speculative/cache_locs.py
                                             assign_draft_cache_locs_contiguous
    fill_bonus_tokens_cpu                    kernels/ops/speculative/eagle.py fill_bonus_tokens
    fill_accept_out_cache_loc_cpu            kernels/ops/speculative/eagle.py
                                             fill_accept_out_cache_loc
    build_tree_kernel_efficient_cpu          kernels/ops/speculative/spec_tree.py
                                             sgl_build_tree_kernel_efficient_triton
    verify_tree_greedy_cpu                   kernels/ops/speculative/spec_tree.py
                                             verify_tree_greedy_kernel_triton
    reconstruct_indices_from_tree_mask_cpu   kernels/ops/speculative/reconstruct_tree.py
                                             _reconstruct_tree_mask_kernel
    copy_all_layer_kv_cache_cpu              kernels/ops/kvcache/cache_move.py
                                             copy_all_layer_kv_cache_tiled

Each is written from what the op computes (request -> KV slot tables, the draft tree's links
and mask, the greedy walk down the tree, KV rows moved), not from the kernel's code;
`tools/golden/check_sglang_cpu_ops.py` runs each against SGLang's own Triton kernel (under
Triton's interpreter, `TRITON_INTERPRET=1`) on random inputs and checks equal outputs (the KV
move against the same copy done with tensor indexing). They move indices and bytes: none of
them takes a scheduling decision (which request runs, how many tokens, whose KV is kept).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch

_LIB = torch.library.Library("sgl_kernel", "FRAGMENT")
REGISTERED: list[str] = []


def _register(schema: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Define `sgl_kernel::<schema>` and make `fn` its CPU implementation."""
    name = schema.split("(", 1)[0]

    def wrap(fn: Callable[..., None]) -> Callable[..., None]:
        _LIB.define(schema)
        _LIB.impl(name, fn, "CPU")
        REGISTERED.append(name)
        return fn

    return wrap


def _runs(start: torch.Tensor, end: torch.Tensor) -> list[tuple[int, int, int]]:
    """(start, end, offset) per request: its span [start, end) of a request-to-token row and
    where its run begins in a packed list of slots (the earlier requests' lengths summed)."""
    out, offset = [], 0
    for s, e in zip(start.tolist(), end.tolist(), strict=True):
        out.append((s, e, offset))
        offset += e - s
    return out


# --- request -> KV slot tables ---------------------------------------------------------------


@_register("assign_req_to_token_pool_cpu(Tensor req_pool_indices, Tensor(a!) req_to_token, "
           "Tensor start_offset, Tensor end_offset, Tensor out_cache_loc, int pool_len) -> ()")
def assign_req_to_token_pool(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                             start_offset: torch.Tensor, end_offset: torch.Tensor,
                             out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """Write newly allocated KV slots into the requests' rows: request i's row, columns
    [start_i, end_i), gets its run of `out_cache_loc` (runs packed in request order)."""
    for row, (s, e, offset) in zip(req_pool_indices.tolist(), _runs(start_offset, end_offset),
                                   strict=True):
        if e > s:
            req_to_token[row, s:e] = out_cache_loc[offset:offset + e - s]


@_register("assign_extend_cache_locs_cpu(Tensor req_pool_indices, Tensor req_to_token, "
           "Tensor start_offset, Tensor end_offset, Tensor(a!) out_cache_loc, int pool_len) -> ()")
def assign_extend_cache_locs(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                             start_offset: torch.Tensor, end_offset: torch.Tensor,
                             out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """The reverse lookup: gather the slots of each request's columns [start_i, end_i) into
    `out_cache_loc`, packed in request order (the verify's tokens' slots)."""
    for row, (s, e, offset) in zip(req_pool_indices.tolist(), _runs(start_offset, end_offset),
                                   strict=True):
        if e > s:
            out_cache_loc[offset:offset + e - s] = req_to_token[row, s:e]


@_register("assign_draft_cache_locs_contiguous_cpu(Tensor req_pool_indices, Tensor req_to_token, "
           "Tensor seq_lens, Tensor(a!) out_cache_loc, int pool_len, int topk, int num_steps) "
           "-> ()")
def assign_draft_cache_locs_contiguous(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                       seq_lens: torch.Tensor, out_cache_loc: torch.Tensor,
                                       pool_len: int, topk: int, num_steps: int) -> None:
    """The draft passes' slots: for request i, the topk * num_steps columns of its row that
    follow its sequence, into block i of `out_cache_loc`."""
    width = topk * num_steps
    for i, (row, s) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist(),
                                     strict=True)):
        out_cache_loc[i * width:(i + 1) * width] = req_to_token[row, s:s + width]


# --- after a verification --------------------------------------------------------------------


@_register("fill_bonus_tokens_cpu(Tensor accept_tokens, Tensor accept_lens, "
           "Tensor(a!) bonus_tokens, int accept_stride) -> ()")
def fill_bonus_tokens(accept_tokens: torch.Tensor, accept_lens: torch.Tensor,
                      bonus_tokens: torch.Tensor, accept_stride: int) -> None:
    """Each request's last accepted token (its `accept_lens` count includes the bonus token):
    row i of `accept_tokens`, `accept_stride` wide, at column accept_lens[i] - 1."""
    flat = accept_tokens.reshape(-1)
    for i, n in enumerate(accept_lens.tolist()):
        bonus_tokens[i] = flat[i * accept_stride + n - 1]


@_register("fill_accept_out_cache_loc_cpu(Tensor accept_index, Tensor out_cache_loc, "
           "Tensor(a!) accept_out_cache_loc) -> ()")
def fill_accept_out_cache_loc(accept_index: torch.Tensor, out_cache_loc: torch.Tensor,
                              accept_out_cache_loc: torch.Tensor) -> None:
    """The KV slots of the accepted tokens, packed: `accept_index` lists verify positions
    (-1: none), and each listed one's slot goes to the next free place of the output."""
    picked = [p for p in accept_index.reshape(-1).tolist() if p != -1]
    if picked:
        accept_out_cache_loc[:len(picked)] = out_cache_loc[torch.tensor(picked)]


# --- the draft tree ---------------------------------------------------------------------------


def _eagle_parents(selected: list[int], parent_list: list[int] | None, topk: int) -> list[int]:
    """The parent node of every node of an EAGLE draft tree (node 0 is the verified token; node
    j >= 1 is the draft candidate `selected[j - 1]`): a candidate c hangs under the root when
    c // topk is 0, else under the node whose candidate is parent_list[c // topk] (the first
    such node). -1 for the root, and for a node whose parent candidate was not selected."""
    node_of: dict[int, int] = {}
    for j, c in enumerate(selected):
        node_of.setdefault(c, j + 1)
    parents = [-1]
    for c in selected:
        group = c // topk
        if group == 0:
            parents.append(0)
        else:
            assert parent_list is not None
            parents.append(node_of.get(parent_list[group], -1))
    return parents


def _write_links(parents: list[int], base: int, next_token: torch.Tensor,
                 next_sibling: torch.Tensor) -> None:
    """A node's first child is its lowest-numbered child, and each child's next sibling the
    next higher-numbered child of the same parent (flat, from `base`)."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        if parent >= 0:
            children.setdefault(parent, []).append(node)
    for parent, kids in children.items():
        next_token[base + parent] = kids[0]
        for a, b in zip(kids, kids[1:], strict=False):
            next_sibling[base + a] = b


@_register("build_tree_kernel_efficient_cpu(Tensor parent_list, Tensor selected_index, "
           "Tensor verified_seq_len, Tensor(a!) tree_mask, Tensor(b!) positions, "
           "Tensor(c!) retrive_index, Tensor(d!) retrive_next_token, "
           "Tensor(e!) retrive_next_sibling, int topk, int depth, int draft_token_num, "
           "int tree_mask_mode) -> ()")
def build_tree_kernel_efficient(parent_list: torch.Tensor, selected_index: torch.Tensor,
                                verified_seq_len: torch.Tensor, tree_mask: torch.Tensor,
                                positions: torch.Tensor, retrive_index: torch.Tensor,
                                retrive_next_token: torch.Tensor,
                                retrive_next_sibling: torch.Tensor, topk: int, depth: int,
                                draft_token_num: int, tree_mask_mode: int) -> None:
    """The verify tree of each request from the draft passes' choices: its links (first child,
    next sibling; untouched entries keep what the caller filled in, -1), each node's flat index,
    its position (sequence length + its depth), and its attention mask over the tree's nodes
    (itself and its ancestors, at most `depth` of them besides the root). Mask modes: 0
    (FULL_MASK: each request's block holds n rows of seq_len + n columns, the tree's columns
    after the sequence's, which this leaves as they are) and 1 (QLEN_ONLY: n x n per request)."""
    assert tree_mask_mode in (0, 1), tree_mask_mode
    n = draft_token_num
    seq_lens = verified_seq_len.tolist()
    selected = selected_index.reshape(len(seq_lens), -1).tolist()
    parents_flat = (parent_list.reshape(len(seq_lens), -1).tolist() if parent_list.numel()
                    else [None] * len(seq_lens))
    mask, pos = tree_mask.view(-1), positions.view(-1)
    index, nxt, sib = (retrive_index.view(-1), retrive_next_token.view(-1),
                       retrive_next_sibling.view(-1))
    sequence_before = 0  # the earlier requests' sequence lengths (FULL_MASK rows are wider)
    for b, seq_len in enumerate(seq_lens):
        parents = _eagle_parents(selected[b][:n - 1], parents_flat[b], topk)
        for node in range(n):
            index[b * n + node] = b * n + node
        _write_links(parents, b * n, nxt, sib)
        for node in range(n):
            if tree_mask_mode == 0:
                row_width = seq_len + n
                root_col = b * n * n + sequence_before * n + node * row_width + seq_len
            else:
                root_col = b * n * n + node * n
            # The root's column is always visible; the draft nodes' only along the path up.
            mask[root_col] = 1
            mask[root_col + 1:root_col + n] = 0
            depth_of, walk, steps = 0, node, 0
            while walk > 0 and steps < depth:
                mask[root_col + walk] = 1
                depth_of += 1
                steps += 1
                walk = parents[walk]
            pos[b * n + node] = seq_len + depth_of
        sequence_before += seq_len


@_register("verify_tree_greedy_cpu(Tensor(a!) predicts, Tensor(b!) accept_index, "
           "Tensor(c!) accept_token_num, Tensor candidates, Tensor retrive_index, "
           "Tensor retrive_next_token, Tensor retrive_next_sibling, Tensor target_predict) -> ()")
def verify_tree_greedy(predicts: torch.Tensor, accept_index: torch.Tensor,
                       accept_token_num: torch.Tensor, candidates: torch.Tensor,
                       retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
                       retrive_next_sibling: torch.Tensor, target_predict: torch.Tensor) -> None:
    """Greedy verification: from the root, go down to the child whose draft token is the
    target's argmax at the current node (the first such among the siblings), as long as one
    is and at most accept_index.shape[1] - 1 levels; `accept_index` gets the visited nodes'
    flat indices (root first), `accept_token_num` how many drafts were accepted, and
    `predicts` at each visited node the target's token there."""
    bs, n = candidates.shape[0], candidates.shape[1]
    levels = accept_index.shape[1]
    cand = candidates.reshape(bs, n).tolist()
    index = retrive_index.reshape(bs, n).tolist()
    first_child = retrive_next_token.reshape(bs, n).tolist()
    next_sibling = retrive_next_sibling.reshape(bs, n).tolist()
    target = target_predict.reshape(-1).tolist()
    flat_predicts = predicts.view(-1)
    for b in range(bs):
        node, flat = 0, index[b][0]
        accept_index[b, 0] = flat
        accepted = 0
        while accepted < levels - 1:
            want = target[flat]
            child = first_child[b][node]
            while child != -1 and cand[b][child] != want:
                child = next_sibling[b][child]
            if child == -1:
                break
            flat_predicts[flat] = want
            accepted += 1
            node, flat = child, index[b][child]
            accept_index[b, accepted] = flat
        accept_token_num[b] = accepted
        flat_predicts[flat] = target[flat]


@_register("reconstruct_indices_from_tree_mask_cpu(Tensor tree_mask, Tensor verified_seq_len, "
           "Tensor(a!) positions, Tensor(b!) retrive_index, Tensor(c!) retrive_next_token, "
           "Tensor(d!) retrive_next_sibling, int batch_size, int draft_token_num) -> ()")
def reconstruct_indices_from_tree_mask(tree_mask: torch.Tensor, verified_seq_len: torch.Tensor,
                                       positions: torch.Tensor, retrive_index: torch.Tensor,
                                       retrive_next_token: torch.Tensor,
                                       retrive_next_sibling: torch.Tensor, batch_size: int,
                                       draft_token_num: int) -> None:
    """NGRAM's tree from its ancestor mask (`tree_mask[b, i, j]`: node j is an ancestor of
    node i, for j < i): each node's depth (its ancestors) after the sequence, its flat index,
    its parent (the nearest ancestor, the highest-numbered one), and from the parents the
    links as for EAGLE's tree; a node with no parent has no sibling link."""
    n = draft_token_num
    masks = tree_mask.reshape(batch_size, n, n).tolist()
    seq_lens = verified_seq_len.tolist()
    pos, index = positions.view(-1), retrive_index.view(-1)
    nxt, sib = retrive_next_token.view(-1), retrive_next_sibling.view(-1)
    for b in range(batch_size):
        ancestors = [[j for j in range(i) if masks[b][i][j]] for i in range(n)]
        parents = [max(a, default=-1) for a in ancestors]
        for node in range(n):
            pos[b * n + node] = seq_lens[b] + len(ancestors[node])
            index[b * n + node] = b * n + node
            nxt[b * n + node] = -1
            sib[b * n + node] = -1
        # First child: the lowest-numbered node that has this one among its ancestors (not
        # only as parent: that is what the op computes).
        for node in range(n):
            below = [k for k in range(node + 1, n) if node in ancestors[k]]
            if below:
                nxt[b * n + node] = below[0]
        for node in range(n):
            if parents[node] >= 0:
                later = [k for k in range(node + 1, n) if parents[k] == parents[node]]
                if later:
                    sib[b * n + node] = later[0]


# --- KV rows ----------------------------------------------------------------------------------


@_register("copy_all_layer_kv_cache_cpu(Tensor data_ptrs, Tensor strides, Tensor tgt_loc, "
           "Tensor src_loc) -> ()")
def copy_all_layer_kv_cache(data_ptrs: torch.Tensor, strides: torch.Tensor,
                            tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
    """Move KV rows within every layer's buffer: row tgt_loc[i] = row src_loc[i] (all rows
    read before any is written, so overlapping moves are safe). The buffers are known by raw
    address and row stride in bytes."""
    tgt, src = tgt_loc.tolist(), src_loc.tolist()
    if not tgt:
        return
    num_rows = max(max(tgt), max(src)) + 1
    for address, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        raw: Any = (ctypes.c_uint8 * (num_rows * stride)).from_address(address)
        rows = torch.frombuffer(raw, dtype=torch.uint8).view(num_rows, stride)
        rows[torch.tensor(tgt)] = rows[torch.tensor(src)].clone()

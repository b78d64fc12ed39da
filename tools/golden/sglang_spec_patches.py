"""What `tools/golden/record_sglang_spec.py` replaces in SGLang 0.5.23 for speculative decoding to
run on a CPU without the sgl-kernel CPU build, and with an acceptance it chooses. Each is model
computation or data, never a scheduling decision: which requests run in a step, how many tokens
each computes, how much KV each holds and who is retracted stay SGLang's own code.

* `tools.golden.sglang_cpu_ops` (imported here): torch stand-ins for the `sgl_kernel` `*_cpu`
  index ops (checked against SGLang's Triton kernels by `tools/golden/check_sglang_cpu_ops.py`).
* `install_null_attention`: SGLang has no CPU attention for a verify (a tree of drafts) or for
  the draft model's passes other than the AMX build's; torch_native's `forward_extend` /
  `forward_decode` (every target and draft attention call here) write the new K/V into the KV
  pool at `out_cache_loc` as torch_native does, and return zeros instead of attending, and the
  draft worker's attention backends (multi-step decode, draft extend) are torch_native ones.
  The model's other layers (embedding, MLP, LM head, logits processor, sampling) run as is.
* `install_overlap_gather`: the overlap loop's future map gathers a batch's spec extras
  (`gather_spec_extras`, a Triton kernel with no CPU branch) by row: the same row gather in
  torch.
* `allow_overlap_on_cpu`: SGLang turns the overlap loop off for speculative decoding on a CPU
  (`_disable_overlap_schedule_for_cpu`, arg_groups/speculative_hook.py) because its GPU kernels
  are missing there; with the two replacements above the overlap loop (spec v2, the default on a
  GPU) runs, so that switch is made a no-op when a workload asks for the overlap loop.
* `propose_full_ngram_chains`: NGRAM's drafts come from a corpus of the tokens seen; over
  the recorder's dummy tokens it proposes fewer than D - 1 real drafts (SGLang pads the rest),
  which would cap acceptance below the draw. The corpus lookup's answer (`NgramCorpus.batch_get`,
  a C++ trie walk) is replaced by a chain of D - 1 drafts under the last token for every request
  (D tokens, each node the child of the one before). D is SGLang's, and every request verifies
  D tokens either way; only the drafts' values and tree shape change.
* `shape_draft_trees`: with eagle_topk > 1, EAGLE builds each request's tree of
  num_draft_tokens - 1 drafts from its draft model's top-k probabilities at every pass (the
  best cumulative scores); a dummy-weight draft gives near-uniform ones, and so trees of any
  shape, often without a path num_steps deep. The draft's top-k probabilities
  (`fast_topk` in eagle_worker_v2) are set to 0.9, 0.09, 0.009, ... (the tokens stay the
  draft's), so every tree holds a chain of num_steps first branches and acceptance can reach
  num_steps deep. Drafts are data; the tree's size (num_draft_tokens) is SGLang's either way.
* `impose_acceptance`: the target's verify logits are overwritten before SGLang's own greedy
  verification (`eagle_sample` -> `verify_tree_greedy`) so that it accepts the number of drafts
  the recorder asks for, along the tree's deepest path (the chain itself for a top-1 tree).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tools.golden import sglang_cpu_ops  # noqa: F401  (registers the torch.ops.sgl_kernel ops)


def _null_attention(self: Any, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any,
                    save_kv_cache: bool = True, **_: Any) -> Any:
    """torch_native's KV write, then zeros of the attention output's shape."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    loc = forward_batch.encoder_out_cache_loc if layer.is_cross_attention else (
        forward_batch.out_cache_loc)
    if save_kv_cache and k is not None and v is not None:
        self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(loc, self.swa_out_cache_loc), k, v)
    num_tokens = q.reshape(q.shape[0], -1).shape[0]
    return q.new_zeros((num_tokens, layer.tp_q_head_num * layer.v_head_dim))


class _DraftStepsBackend:
    """Stands for a draft worker's multi-step decode backend (`*MultiStepDraftBackend`): one
    torch_native backend (null attention) per draft pass."""

    def __init__(self, model_runner: Any, topk: int, num_steps: int) -> None:
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

        self.topk = topk
        self.speculative_num_steps = num_steps
        self.attn_backends = [TorchNativeAttnBackend(model_runner) for _ in range(num_steps)]

    def init_forward_metadata(self, forward_batch: Any) -> None:
        for backend in self.attn_backends:
            backend.init_forward_metadata(forward_batch)

    def init_cuda_graph_state(self, *args: Any, **kwargs: Any) -> None:
        pass  # (CUDA graphs are off)


def install_null_attention() -> None:
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    TorchNativeAttnBackend.forward_extend = _null_attention  # type: ignore[method-assign]
    TorchNativeAttnBackend.forward_decode = _null_attention  # type: ignore[method-assign]

    def create_decode_backend(factory: Any) -> Any:
        return _DraftStepsBackend(factory.draft_model_runner, factory.topk,
                                  factory.speculative_num_steps)

    def create_draft_extend_backend(factory: Any) -> Any:
        return TorchNativeAttnBackend(factory.draft_model_runner)

    DraftBackendFactory.create_decode_backend = create_decode_backend  # type: ignore[method-assign]
    DraftBackendFactory.create_draft_extend_backend = (  # type: ignore[method-assign]
        create_draft_extend_backend)


def install_overlap_gather() -> None:
    from sglang.srt.managers import overlap_utils

    def gather_spec_extras(indices: Any, topk_p_buf: Any, topk_index_buf: Any,
                           output_tokens_buf: Any, hidden_states_buf: Any) -> Any:
        rows = indices.long()
        return (topk_p_buf[rows].clone(), topk_index_buf[rows].clone(),
                output_tokens_buf[rows].clone(),
                None if hidden_states_buf is None else hidden_states_buf[rows].clone())

    overlap_utils.gather_spec_extras = gather_spec_extras


def allow_overlap_on_cpu() -> None:
    from sglang.srt.arg_groups import speculative_hook

    speculative_hook._disable_overlap_schedule_for_cpu = lambda server_args: None


# Token ids of the NGRAM chain's drafts (any ids of the vocabulary do: the imposed acceptance
# makes the target agree with as many as it is told).
_CHAIN_TOKEN_BASE = 1000


def propose_full_ngram_chains() -> None:
    import numpy as np
    from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus

    original = NgramCorpus.batch_get

    def batch_get(self: Any, req_ids: list[str], batch_tokens: list[list[int]],
                  total_lens: list[int]) -> tuple[Any, Any]:
        # SGLang's lookup still runs (its match state advances as it would); its answer is
        # then replaced, keeping each request's first token (the last one sampled, the root).
        drafts, mask = original(self, req_ids, batch_tokens, total_lens)
        bs = len(req_ids)
        n = drafts.size // bs
        new_drafts = np.asarray(drafts).reshape(bs, n).copy()
        new_drafts[:, 1:] = _CHAIN_TOKEN_BASE + np.arange(1, n)
        # A chain: node i's ancestors are every node before it (and itself).
        chain = np.tril(np.ones((n, n), dtype=np.asarray(mask).dtype))
        new_mask = np.broadcast_to(chain, (bs, n, n)).copy()
        return (new_drafts.reshape(np.shape(drafts)), new_mask.reshape(np.shape(mask)))

    NgramCorpus.batch_get = batch_get  # type: ignore[method-assign]


# The draft's top-k probabilities given to a tree (topk > 1) of every pass: the first branch
# far likelier than the next ones (0.9, 0.09, 0.009, ...).
_FIRST_BRANCH_P, _NEXT_BRANCH_RATIO = 0.9, 0.1


def shape_draft_trees() -> None:
    import torch
    from sglang.srt.speculative import eagle_worker_v2

    original = eagle_worker_v2.fast_topk

    def fast_topk(values: Any, topk: int, dim: int) -> Any:
        # The draft's own choice of tokens; its probabilities replaced by fixed ones.
        topk_p, topk_index = original(values, topk, dim=dim)
        if topk > 1:
            profile = torch.tensor([_FIRST_BRANCH_P * _NEXT_BRANCH_RATIO**j for j in range(topk)],
                                   dtype=topk_p.dtype, device=topk_p.device)
            topk_p = profile.expand_as(topk_p).clone()
        return topk_p, topk_index

    eagle_worker_v2.fast_topk = fast_topk


def _deepest_path(first_child: list[int], next_sibling: list[int]) -> list[int]:
    """The longest root-to-leaf path of a tree given by its links (node 0 the root); among
    equally long ones the first in child order."""
    best: list[int] = [0]
    stack = [[0]]
    while stack:
        path = stack.pop()
        if len(path) > len(best):
            best = path
        children = []
        child = first_child[path[-1]]
        while child != -1:
            children.append(child)
            child = next_sibling[child]
        stack.extend(path + [c] for c in reversed(children))
    return best


def impose_acceptance(accepted: Callable[[Any, int], int],
                      on_verify: Callable[[Any, list[int]], None]) -> None:
    """`accepted(req, seq_len)`: the drafts request `req` (KV length `seq_len` before the
    verify) accepts. In every verify's logits (one row per tree node, `draft_token_num` rows a
    request) all rows are zeroed, then along the deepest path p_0 (the root) .. p_d the row of
    p_j (j < a) is 1 at p_{j+1}'s token, and the row of p_a is 1 at a token none of p_a's
    children carries: SGLang's greedy walk then accepts exactly a drafts (checked). `on_verify`
    gets the batch and what SGLang's verification accepted per request."""
    from sglang.srt.speculative import eagle_utils, eagle_worker_common, ngram_worker

    original = eagle_utils.eagle_sample

    def eagle_sample(verify_input: Any, batch: Any, logits_output: Any, *args: Any,
                     **kwargs: Any) -> Any:
        if batch.forward_mode.is_idle():
            return original(verify_input, batch, logits_output, *args, **kwargs)
        n = verify_input.draft_token_num
        bs = len(batch.reqs)
        tokens = verify_input.draft_token.reshape(bs, n).tolist()
        first_child = verify_input.retrieve_next_token.reshape(bs, n).tolist()
        next_sibling = verify_input.retrieve_next_sibling.reshape(bs, n).tolist()
        seq_lens = batch.seq_lens.tolist()
        logits = logits_output.next_token_logits
        assert logits.shape[0] == bs * n, (logits.shape, bs, n)
        logits.zero_()
        wanted = []
        for b, req in enumerate(batch.reqs):
            path = _deepest_path(first_child[b], next_sibling[b])
            a = accepted(req, int(seq_lens[b]))
            assert 0 <= a < len(path), (req.rid, a, path)
            wanted.append(a)
            for j in range(a):
                logits[b * n + path[j], tokens[b][path[j + 1]]] = 1.0
            taken = set()
            child = first_child[b][path[a]]
            while child != -1:
                taken.add(tokens[b][child])
                child = next_sibling[b][child]
            stop = next(t for t in range(7, 7 + n + 2) if t not in taken)
            logits[b * n + path[a], stop] = 1.0
        out = original(verify_input, batch, logits_output, *args, **kwargs)
        got = (out[1] - 1).tolist()  # accept lengths count the bonus token
        assert got == wanted, (got, wanted)
        on_verify(batch, got)
        return out

    for module in (eagle_utils, eagle_worker_common, ngram_worker):
        if getattr(module, "eagle_sample", None) is original:
            module.eagle_sample = eagle_sample

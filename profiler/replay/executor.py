"""The executor: the seam beside the latency model. A latency model says how long a plan's
`BatchShape` would take; the executor runs the plan for real, as one forward pass of the
profiler's decoder, and says how long it took.

It keeps, in lockstep with the scheduler's KV accounting, which pool blocks hold each request's
tokens (`BlockMap`), and each request's token ids: its prompt (random ids from the seed and the
request id) and the tokens it sampled (argmax; output lengths come from the trace, there is no
EOS), so a request recomputed after preemption recomputes the very same ids at the same positions.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

import torch

from profiler.measure.model import Decoder, SeqInput
from profiler.replay.blocks import BlockMap
from sim.core.kv_cache import KVCacheManager, cdiv
from sim.core.plan import Plan
from sim.core.request import Request
from sim.hardware.models import ModelShape


class Executor:
    """Runs plans on a device: `run(plan, requests)` between the scheduler's `schedule` and the
    state's `commit`, then `release(finished)` after the commit."""

    def __init__(self, shape: ModelShape, kv: KVCacheManager, *, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, seed: int = 0,
                 attention: str = "sdpa") -> None:
        self.kv = kv
        self.blocks = BlockMap(kv.num_blocks, kv.block_size)
        self.decoder = Decoder(shape, kv.num_blocks * kv.block_size, device=device, dtype=dtype,
                               seed=seed, attention=attention, block_size=kv.block_size)
        self.seed = seed
        self.cuda = device.startswith("cuda")
        self.tokens: dict[int, torch.Tensor] = {}
        self.num_scattered = 0  # requests of the last plan whose KV had to be gathered

    def run(self, plan: Plan, requests: Mapping[int, Request]) -> float:
        """Place the plan's KV as the accounting says, run one forward pass, sample the
        requests that caught up. Returns the seconds of the forward pass alone."""
        seqs = self.prepare(plan, requests)
        start = time.perf_counter()
        logits = self.decoder.forward(seqs)
        if self.cuda:
            torch.cuda.synchronize()
        forward_s = time.perf_counter() - start
        self.sample(plan, requests, logits)
        return forward_s

    def prepare(self, plan: Plan, requests: Mapping[int, Request]) -> list[SeqInput]:
        """Each scheduled request's new token ids, at its cached context, in its blocks."""
        bs = self.kv.block_size
        for request_id in plan.preempted_ids:
            self.release_id(request_id)
        seqs = []
        self.num_scattered = 0
        for request_id, num_new in plan.num_scheduled_tokens.items():
            req = requests[request_id]
            held = self.kv.num_held_blocks(request_id)
            self.blocks.grow(request_id, held, cdiv(req.num_max_kv_tokens, bs))
            cached = req.num_computed_tokens
            assert held * bs >= cached + num_new, "KV accounting gave too few blocks"
            ids = self._token_ids(req)[cached:cached + num_new]
            samples = cached + num_new == req.num_tokens
            blocks = self.blocks.blocks[request_id]
            if self.blocks.contiguous(request_id):
                seqs.append(SeqInput(blocks[0] * bs, cached, ids, samples))
            else:
                self.num_scattered += 1
                seqs.append(SeqInput(0, cached, ids, samples, torch.tensor(blocks)))
        assert self.blocks.num_used_blocks == self.kv.num_used_blocks, "KV map out of step"
        return seqs

    def sample(self, plan: Plan, requests: Mapping[int, Request], logits: torch.Tensor) -> None:
        """Greedy sampling: each caught-up request's next token id is its logits' argmax."""
        sampling = [rid for rid, n in plan.num_scheduled_tokens.items()
                    if requests[rid].num_computed_tokens + n == requests[rid].num_tokens]
        if not sampling:
            return
        for request_id, token in zip(sampling, logits.argmax(-1).tolist(), strict=True):
            ids, position = self.tokens[request_id], requests[request_id].num_tokens
            if position < len(ids):
                ids[position] = token

    def release(self, finished: Iterable[Request]) -> None:
        """Requests that left (finished): their blocks and token ids go."""
        for req in finished:
            self.release_id(req.request_id)
            self.tokens.pop(req.request_id, None)

    def release_id(self, request_id: int) -> None:
        self.blocks.release(request_id)

    def warm_up(self, num_tokens: int, num_decodes: int, reps: int = 3) -> None:
        """Untimed passes of a prefill chunk and of a decode batch before the clock starts (the
        first calls pay for allocation and kernel selection). Writes only slots no request holds
        yet."""
        assert not self.blocks.blocks, "warm up before serving"
        vocab = self.decoder.shape.vocab_size
        bs = self.kv.block_size
        num_slots = self.kv.num_blocks * bs
        num_tokens = max(1, min(num_tokens, num_slots))
        gen = torch.Generator().manual_seed(self.seed)
        chunk = [SeqInput(0, 0, torch.randint(0, vocab, (num_tokens,), generator=gen), True)]
        context = max(1, min(256, num_slots // max(1, num_decodes) - bs))
        stride = cdiv(context + 1, bs) * bs
        decodes = [SeqInput(i * stride, context, torch.randint(0, vocab, (1,), generator=gen),
                            True) for i in range(min(num_decodes, num_slots // stride))]
        for _ in range(reps):
            for seqs in (chunk, decodes):
                if seqs:
                    self.decoder.forward(seqs)
        if self.cuda:
            torch.cuda.synchronize()

    def _token_ids(self, req: Request) -> torch.Tensor:
        ids = self.tokens.get(req.request_id)
        if ids is None:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + req.request_id)
            size = req.num_prompt_tokens + req.num_target_output_tokens
            ids = torch.randint(0, self.decoder.shape.vocab_size, (size,), generator=gen)
            self.tokens[req.request_id] = ids
        return ids

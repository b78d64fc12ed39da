"""vLLM's CPU tier for the KV cache (`--kv-offloading-size`, the native `OffloadingConnector`), as
its scheduler sees it: which prefix blocks the host holds, which a request may load back
instead of computing, which a step stores. No time here: the engine times the copies
(`sim.engine.offload`) and reports the finished ones back (`transfers_done`).

The rules, from vLLM 0.15.1 (`distributed/kv_transfer/kv_connector/v1/offloading_connector.py`,
`OffloadingConnectorScheduler`; `v1/kv_offload/lru_manager.py`, `backends/cpu.py`):
- The tier holds `num_blocks` blocks of the GPU's block size, each under its prefix's chain
  hash, least recently used first. A block is loadable once its store has completed
  (`BlockStatus.ref_cnt` -1 until then) and cannot be evicted while a load reads it.
- Every full block a scheduled request computes is stored, in order, once
  (`_get_reqs_to_store`: from `_next_stored_block_idx` to the blocks full after the step; only
  blocks whose tokens are known: with async scheduling, a block completed by a token still in
  flight has no hash yet and is skipped for good). Blocks already held are not stored again.
  A store that needs more room than the unreferenced blocks give is refused, and tried again
  at the next step (`prepare_store` returns None). A store touches the request's blocks.
- A store completes, and its blocks become loadable, only when the worker reports the request
  as finished sending: after the request finished and all its copies are done
  (`OffloadingConnectorWorker.get_finished`); or at once when the request is preempted
  (`build_connector_meta`). A request that stored anything keeps its GPU blocks after it
  finishes until then (`request_finished` returns True: the scheduler delays the free).
- A queued request with nothing computed, after its GPU prefix hit, looks up the blocks that
  follow in the tier (`get_num_new_matched_tokens`: it first touches all its full blocks; the
  hit is the run of loadable blocks from the first one the GPU lacks, at least one block, and
  may reach the request's last token). If any of them is being loaded for another request it
  waits (None: skipped this step). Otherwise it gets GPU blocks for hit plus load, holds them
  in the queue while the copy runs (`WAITING_FOR_REMOTE_KVS`), and stores from the end of
  what it loads.
- On a disaggregated cluster's decode replica vLLM runs this connector beside the
  KV-transfer one (a `MultiConnector`, NIXL listed first). Paths below are 0.15.1's under
  `distributed/kv_transfer/kv_connector/v1/`. The queue asks both connectors for every
  request (`multi_connector.py:284-303`): this one looks up and touches, and a None skips
  the request; but NIXL has the whole prompt (`nixl_connector.py:632-637`), so the request
  is NIXL's and this connector is told of its blocks with no tokens to load
  (`multi_connector.py:305-316`; `offloading_connector.py:268` returns there, setting no
  `_next_stored_block_idx`). At the request's first step there (the prompt's last token
  computed again), its full prompt blocks are therefore stored from block 0
  (`offloading_connector.py:324`): the KV the transfer brought. Its decode blocks follow as
  above; its finish waits for its stores (`offloading_connector.py:437`; NIXL delays
  nothing on a decode instance). NIXL clears the request's remote flag after its one
  transfer (`nixl_connector.py:696`), so a request preempted there is looked up as any
  other and may load from this tier. Such a request is a new one to vLLM's scheduler when
  its KV has arrived (`scheduled_new_reqs`): its stores come first (`build`).
Only counts and hashes are kept: no object per token.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sim.core.block_cache import BlockPrefixCache

if TYPE_CHECKING:
    from sim.core.plan import Plan
    from sim.core.request import Request
    from sim.core.state import ReplicaState

NOT_READY = -1  # a block whose store has not completed: not loadable, not evictable


@dataclass(slots=True)
class TierCounters:
    """What the tier did over a run (`summary.kv_offload`)."""

    num_lookups: int = 0  # queued requests that asked the tier
    num_hit_requests: int = 0  # of those, requests that loaded from it
    num_hit_tokens: int = 0  # tokens loaded instead of computed
    # Of those, what requests loaded at their first admission and count as computed (their
    # `num_cached_tokens`, with the GPU's hit; reloads after a preemption are not in it).
    num_first_hit_tokens: int = 0
    num_loaded_blocks: int = 0
    num_stored_blocks: int = 0
    num_evicted_blocks: int = 0
    num_refused_stores: int = 0  # stores refused for want of room (tried again)
    num_skipped_stores: int = 0  # blocks not stored: offered fewer than `store_threshold` times
    num_delayed_lookups: int = 0  # lookups deferred: the blocks were being loaded


@dataclass(slots=True)
class Transfers:
    """A step's copies: loads (request id, blocks) into the GPU and stores out of it."""

    loads: list[tuple[int, int]] = field(default_factory=list)
    stores: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class Report:
    """What a poll found done: requests finished sending (stores) and receiving (loads), and
    (vLLM 0.33.0) the copy jobs done."""

    finished_sending: list[int] = field(default_factory=list)
    finished_recving: list[int] = field(default_factory=list)
    completed: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.finished_sending or self.finished_recving or self.completed)


class CpuTier:
    """The host's KV blocks and the connector's bookkeeping per request (module docstring)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        # chain hash -> loads reading it (NOT_READY: being stored), least recently used first
        self._blocks: OrderedDict[int, int] = OrderedDict()
        self._next_stored: dict[int, int] = {}  # request id -> its next block to store
        self._being_stored: dict[int, set[int]] = {}  # request id -> hashes it stores
        self._being_loaded: dict[int, list[int]] = {}  # request id -> hashes it loads
        self._blocks_being_loaded: set[int] = set()
        # Blocks evictable now (stored, no load reading them): a store that needs more is
        # refused without looking (under load, every step, for every request that stores).
        self._num_evictable = 0
        self.counters = TierCounters()

    @property
    def num_used_blocks(self) -> int:
        return len(self._blocks)

    # -- the manager (LRU) -----------------------------------------------------------------

    def _touch(self, hashes: Iterable[int]) -> None:
        """Most recently used: the first block last (it is evicted last)."""
        blocks = self._blocks
        for h in reversed(list(hashes)):
            if h in blocks:
                blocks.move_to_end(h)

    def _prepare_store(self, hashes: list[int]) -> list[int] | None:
        """The hashes to store (those not held), room made by evicting unreferenced blocks,
        least recently used first; None if there is not room enough."""
        blocks = self._blocks
        to_store = [h for h in hashes if h not in blocks]
        short = len(to_store) - (self.num_blocks - len(blocks))
        if short > self._num_evictable:
            return None
        if short > 0:
            victims = []
            for h, ref_cnt in blocks.items():
                if ref_cnt == 0:
                    victims.append(h)
                    if len(victims) == short:
                        break
            else:
                return None
            for h in victims:
                del blocks[h]
            self._num_evictable -= len(victims)
            self.counters.num_evicted_blocks += len(victims)
        for h in to_store:
            blocks[h] = NOT_READY
        return to_store

    def _complete_store(self, hashes: Iterable[int]) -> None:
        blocks = self._blocks
        for h in hashes:
            if blocks[h] == NOT_READY:
                blocks[h] = 0
                self._num_evictable += 1

    # -- the connector, scheduler side -----------------------------------------------------

    def lookup(self, hashes: list[int], num_gpu_hit_tokens: int, block_size: int) -> int | None:
        """Tokens a queued request (nothing computed, `hashes` its full blocks' chain hashes)
        would load after its GPU hit of `num_gpu_hit_tokens`: 0 for none, None to wait (its
        blocks are being loaded for another request)."""
        counters = self.counters
        counters.num_lookups += 1
        self._touch(hashes)
        if len(hashes) * block_size - num_gpu_hit_tokens < block_size:
            return 0
        start = num_gpu_hit_tokens // block_size
        blocks = self._blocks
        hits = 0
        for h in hashes[start:]:
            if blocks.get(h, NOT_READY) == NOT_READY:
                break
            hits += 1
        if not hits:
            return 0
        if self._blocks_being_loaded and not self._blocks_being_loaded.isdisjoint(
                hashes[start:start + hits]):
            counters.num_delayed_lookups += 1
            return None
        return (start + hits) * block_size - num_gpu_hit_tokens

    def start_load(self, request_id: int, hashes: list[int]) -> int:
        """The request loads the blocks `hashes` (they follow its GPU hit): they are pinned
        until the load is reported done; it stores from their end. Returns the blocks."""
        blocks = self._blocks
        for h in hashes:
            if not blocks[h]:
                self._num_evictable -= 1
            blocks[h] += 1
        self._being_loaded[request_id] = list(hashes)
        self._blocks_being_loaded.update(hashes)
        counters = self.counters
        counters.num_hit_requests += 1
        counters.num_loaded_blocks += len(hashes)
        return len(hashes)

    def set_next_stored(self, request_id: int, num_blocks: int) -> None:
        self._next_stored[request_id] = num_blocks

    def store(self, request_id: int, hashes: list[int], num_full_blocks: int,
              num_hashed: int | None = None) -> int:
        """A scheduled request will have `num_full_blocks` full blocks after the step, the
        first `num_hashed` of them hashed (tokens known; default all; `hashes` may run
        longer): store those not stored yet. Returns the blocks to copy (0: none, or refused
        for room and tried again next step)."""
        start = self._next_stored.get(request_id, 0)
        if num_full_blocks <= start:
            return 0
        end = num_full_blocks if num_hashed is None else min(num_full_blocks, num_hashed)
        to_store = self._prepare_store(hashes[start:end])
        if to_store is None:
            self.counters.num_refused_stores += 1
            return 0
        self._next_stored[request_id] = num_full_blocks
        if not to_store:
            return 0
        self._touch(hashes[:end])
        self._being_stored.setdefault(request_id, set()).update(to_store)
        self.counters.num_stored_blocks += len(to_store)
        return len(to_store)

    def preempted(self, request_id: int) -> None:
        """A preempted request's stores count as done (its copies are waited for before the
        next step runs: `handle_preemptions`)."""
        hashes = self._being_stored.get(request_id)
        if hashes:
            self._complete_store(hashes)
            hashes.clear()

    def request_finished(self, request_id: int) -> bool:
        """The request finished (or was aborted): whether its GPU blocks must wait for its
        stores (until the worker reports it finished sending)."""
        self._next_stored.pop(request_id, None)
        return request_id in self._being_stored

    def transfers_done(self, finished_sending: Iterable[int], finished_recving: Iterable[int]
                       ) -> None:
        """The worker's report (`update_connector_output`)."""
        for rid in finished_sending:
            hashes = self._being_stored.pop(rid, None)
            if hashes:
                self._complete_store(hashes)
        blocks = self._blocks
        for rid in finished_recving:
            loaded = self._being_loaded.pop(rid, None)
            if loaded:
                self._blocks_being_loaded.difference_update(loaded)
                for h in loaded:
                    blocks[h] -= 1
                    if not blocks[h]:
                        self._num_evictable += 1

    def check(self) -> None:
        """At most `num_blocks` held; loads pin loadable blocks only."""
        assert len(self._blocks) <= self.num_blocks
        pinned: dict[int, int] = {}
        for loaded in self._being_loaded.values():
            for h in loaded:
                pinned[h] = pinned.get(h, 0) + 1
        for h, ref_cnt in self._blocks.items():
            assert ref_cnt == NOT_READY or ref_cnt == pinned.get(h, 0), (h, ref_cnt)
        assert self._num_evictable == sum(not r for r in self._blocks.values())


class OffloadState:
    """A replica's CPU tier with what the scheduler keeps around it (vLLM's
    `WAITING_FOR_REMOTE_KVS` requests, `finished_recving_kv_req_ids`, `finished_req_ids`, and
    finished requests whose blocks wait for their stores)."""

    def __init__(self, tier: CpuTier) -> None:
        self.tier = tier
        # Queued requests holding GPU blocks while their KV is copied in, and, of those, the
        # ones the worker reported done (admitted at the queue pass that reaches them).
        self.loading: dict[int, Request] = {}
        self.loaded: set[int] = set()
        # Finished (or aborted) requests whose GPU blocks wait for their stores.
        self.delayed: dict[int, Request] = {}
        # Handed-off requests whose KV transfer runs (prefill replica): whether their stores
        # are done (the worker's report held back until the transfer ends).
        self.sending: dict[int, bool] = {}
        # Requests finished since the last plan: the worker learns of them with the next.
        self.finished_ids: list[int] = []
        # Loads started since the last plan: (request id, blocks), in order.
        self.loads: list[tuple[int, int]] = []
        # Decode replica: requests whose KV a transfer brings, taken (`remote_lookup`) and
        # not yet scheduled here (`build` stores their prompt blocks at their first step).
        self.remote: set[int] = set()

    busy = False  # (0.15.1's engine steps on for finished requests only: `finished_ids`)

    def remote_lookup(self, state: ReplicaState, req: Request) -> bool:
        """Decode replica: `req`, whose KV a transfer is to bring, is asked for by the queue.
        vLLM runs this connector beside the transfer one there (a `MultiConnector`), which
        asks every connector (`MultiConnector.get_num_new_matched_tokens`,
        `multi_connector.py:284-303` in 0.15.1): the tier is looked up after the GPU hit and
        touched, its hit dropped (the transfer connector, first, claims the request), and
        None, a load of those blocks in progress, skips the request this step (False)."""
        kv = state.kv
        assert isinstance(kv, BlockPrefixCache)
        block_size = kv.block_size
        num_blocks = req.num_prompt_tokens // block_size
        return self.tier.lookup(kv.chain_hashes(req, num_blocks)[:num_blocks],
                                kv.prefix_hit_tokens(req), block_size) is not None
    defers_frees = False  # (0.15.1 frees at once, or once a finished request's stores end)

    def finished(self, state: ReplicaState, req: Request, *, held: bool = False) -> None:
        """`req` finished or was aborted: its blocks are freed now, or once its stores are.
        `held`: a prefill replica's request handed off, its blocks held for the KV transfer
        to a decode replica (`released`). vLLM's transfer connector beside this one (a
        `MultiConnector`) reports the request finished sending only once both are done: its
        stores complete, and its blocks go back, then."""
        rid = req.request_id
        self.finished_ids.append(rid)
        self.loading.pop(rid, None)
        self.loaded.discard(rid)
        self.remote.discard(rid)
        if held:
            self.sending[rid] = False
        if self.tier.request_finished(rid):
            self.delayed[rid] = req
        elif not held:
            state.kv.free(req)

    def released(self, state: ReplicaState, req: Request) -> None:
        """A handed-off request's KV has reached its decode replica: its blocks go back, its
        stores complete, unless its stores are still running (`apply` frees them then)."""
        rid = req.request_id
        if self.sending.pop(rid):  # its stores done: the report held back goes now
            self.tier.transfers_done((rid,), ())
            self.delayed.pop(rid, None)
        elif rid in self.delayed:
            return
        state.kv.free(req)

    def apply(self, state: ReplicaState, report: Report) -> None:
        """The worker's report, with a step's output (`_update_from_kv_xfer_finished`)."""
        finished_sending, finished_recving = report.finished_sending, report.finished_recving
        sending = self.sending
        if sending:  # (held back while their KV transfers run: `finished`)
            for rid in finished_sending:
                if rid in sending:
                    sending[rid] = True
            finished_sending = [rid for rid in finished_sending if rid not in sending]
        self.tier.transfers_done(finished_sending, finished_recving)
        for rid in finished_recving:
            if rid in self.loading:
                self.loaded.add(rid)
        # (vLLM frees them in the order of a set of strings, which Python's hash seed
        # decides; here in request id order, as the golden recorder has it.)
        for rid in sorted(finished_sending):
            req = self.delayed.pop(rid, None)
            if req is not None:
                state.kv.free(req)

    def build(self, state: ReplicaState, plan: Plan, num_running: int) -> None:
        """vLLM's `build_connector_meta`, at the end of a plan (its first `num_running`
        requests from the running pass): the plan's copies (the loads started while it was
        built; the stores of the full blocks its requests complete, in the connector's order:
        new requests, running ones, resumed ones) and the requests finished since the last."""
        kv = state.kv
        assert isinstance(kv, BlockPrefixCache)
        block_size = kv.block_size
        scheduled, requests, tier = plan.num_scheduled_tokens, state.requests, self.tier
        order = list(scheduled)
        remote = self.remote
        for rid in plan.preempted_ids:
            remote.discard(rid)
        joined: list[int] = []
        if remote:  # (decode replica: the KV that arrived is a new request's in vLLM)
            joined = [r for r in order[:num_running] if r in remote]
            if joined:
                remote.difference_update(joined)
                order = [r for r in order if r not in joined]
                num_running -= len(joined)
        if len(order) > num_running or joined:  # admitted: the new ones first, resumed last
            admitted = order[num_running:]
            order = (joined + [r for r in admitted if not requests[r].num_preemptions]
                     + order[:num_running]
                     + [r for r in admitted if requests[r].num_preemptions])
        stores = []
        next_stored = tier._next_stored
        for rid in order:
            req = requests[rid]
            num_full = (req.num_computed_tokens + scheduled[rid]) // block_size
            if num_full <= next_stored.get(rid, 0):
                continue  # (most steps: no block filled; no hashes needed)
            # Blocks of known tokens have a hash (a token in flight is not known yet).
            num_known = (req.num_tokens - req.num_placeholders) // block_size
            num_blocks = tier.store(rid, kv.chain_hashes(req, min(num_full, num_known)),
                                    num_full, num_known)
            if num_blocks:
                stores.append((rid, num_blocks))
        for rid in plan.preempted_ids:
            tier.preempted(rid)
        plan.transfers = Transfers(self.loads, stores)
        self.loads = []
        plan.finished_ids, self.finished_ids = self.finished_ids, []

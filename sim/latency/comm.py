"""Communication of a parallel replica: tensor-parallel all-reduces and gathers, pipeline
hand-offs.

Two sources, chosen per scenario:

- measured tables (`all_reduce_table`, `send_recv_table`): CSV files in the layout Vidur
  publishes its NCCL measurements in (columns `size` in bytes, `num_workers`,
  `devices_per_node`, `time_stats.<collective>.median` in milliseconds), e.g. the H100 DGX
  tables under `../shared/profiles/vidur/network/h100_dgx/`. The rows for the replica's group
  size are made non-decreasing in message size (pool-adjacent-violators: single medians are
  noisy, a larger message never really takes less time) and interpolated linearly; beyond the
  largest message the last tenth of the table's bandwidth carries on.
- the GPU's interconnect (`GPUSpec.interconnect_bandwidth_bytes_s`, one direction): a ring
  all-reduce of B bytes over n GPUs moves 2(n-1)/n * B per GPU, a send moves B, each at
  `interconnect_efficiency` of the link plus a fixed start-up. The defaults (25 us, 8 us, 0.75)
  are least-squares fits to the H100 DGX tables above (NCCL medians: all-reduce over 2/4/8 GPUs
  starts at 24-35 us and reaches 0.68-0.81 of 450 GB/s; an intra-node send starts at 8 us and
  reaches 0.80). Hand-offs between nodes (a pipeline whose stages fill more than one node of
  8 GPUs) go over the GPU's scale-out NIC (`GPUSpec.network_bandwidth_bytes_s`) at the same
  efficiency after a 17 us start-up (the same H100 DGX table's rows across nodes: 17 us at
  2 KiB, 34-36 GB/s = 0.68-0.72 of a 400 Gb/s NIC from 64 MiB; this form gives 0.83-1.00x
  their times from 2 KiB to 256 MiB); a table's rows across nodes (`devices_per_node` 1)
  time them where given.

The tables hold no all-gather (Vidur measured all_reduce and send_recv only), so gathers of
the logits are always timed from the link: each GPU of a ring all-gather receives (n-1)/n of the
gathered bytes (half an all-reduce's traffic), at the same efficiency and all-reduce start-up.

vLLM and SGLang do not all-reduce small messages with NCCL: their custom all-reduce kernel
(vLLM's `csrc/custom_all_reduce.cuh`, `CustomAllreduce` in
`distributed/device_communicators/custom_all_reduce.py`; SGLang uses the same kernel) takes
every message below its buffer (8 MiB; 512 KiB over 6 GPUs and 256 KiB over 8 where
vLLM's symmetric-memory path is on, its default) over 2, 4, 6 or 8 GPUs joined by NVLink
(`CustomAllReduce`). Over 2 GPUs, and below 512 KiB over 4 or 256 KiB over up to 8, it is one
stage (each GPU reads every peer's whole buffer): a + (n-1) S / B1; otherwise two (reduce-
scatter, all-gather): a2 + 2 (n-1)/n S / B2. The four constants are fits to H100 timings
inside CUDA graphs published with vLLM pull requests #24111 and #24532 (bf16, hidden 8192:
1 stage over 4 GPUs 10/14/23/38 us at 0.5/1/2/4 MiB, 2 stages 17/18/26/42 us; over 2
GPUs 7 us at 0.5 MiB): 6 us and 375 GB/s, 11.8 us and 212 GB/s, within 1.5 us of each. Larger
messages (prefill chunks), other group sizes and GPUs on PCIe fall back to the tables or the
link's ring above.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from sim.config.errors import InputError
from sim.config.input_file import FileProblem, read_bytes
from sim.hardware.parallelism import GPUS_PER_NODE

if TYPE_CHECKING:
    from sim.hardware.parallelism import Parallelism

Array = np.ndarray

# The defaults of the latency models' knobs (fits to the H100 DGX tables, see above).
INTERCONNECT_EFFICIENCY = 0.75
ALL_REDUCE_LATENCY_S = 25e-6
SEND_RECV_LATENCY_S = 8e-6
# Vidur's tables are tens of KB: the most read of one, with room to spare.
MAX_TABLE_BYTES = 64 * 2**20


@dataclass(frozen=True)
class MessageTable:
    """Measured seconds by message size, non-decreasing, interpolated linearly."""

    sizes_bytes: Array
    times_s: Array
    tail_s_per_byte: float

    def __call__(self, num_bytes: Array) -> Array:
        x = np.asarray(num_bytes, dtype=np.float64)
        inside = np.interp(x, self.sizes_bytes, self.times_s)
        beyond = self.times_s[-1] + (x - self.sizes_bytes[-1]) * self.tail_s_per_byte
        out: Array = np.where(x > self.sizes_bytes[-1], beyond, inside)
        return np.where(x > 0, out, 0.0)


def read_table(path: Path, collective: str, num_workers: int, field: str, *,
               cross_node: bool = False) -> MessageTable:
    """The rows of `path` for `num_workers` GPUs: all on one node where the table has that, or,
    `cross_node`, each on its own node (`devices_per_node` 1: Vidur's rows across nodes)."""
    column = f"time_stats.{collective}.median"
    try:
        # A FIFO or a device would block or never end: only a regular file is read, bounded.
        text = read_bytes(path, MAX_TABLE_BYTES).decode("utf-8")
        rows = list(csv.DictReader(io.StringIO(text, newline="")))
    except FileProblem as exc:
        raise InputError(path, field, str(path), str(exc)) from None
    except UnicodeDecodeError:
        raise InputError(path, field, str(path), "not UTF-8 text (a CSV is expected)") from None
    except csv.Error as exc:
        raise InputError(path, field, str(path), f"not a CSV: {exc}") from None
    if not rows or any(c not in rows[0] for c in (column, "size", "num_workers")):
        raise InputError(path, field, str(path),
                         f"needs columns size, num_workers and {column} (Vidur's layout)")
    try:
        picked = [r for r in rows if int(r["num_workers"]) == num_workers]
        if cross_node:
            picked = [r for r in picked if int(r.get("devices_per_node") or 0) == 1]
            if len(picked) < 2:
                raise InputError(path, field, str(path),
                                 f"has no rows across nodes for {num_workers} GPUs "
                                 "(devices_per_node 1), which this replica's pipeline needs: "
                                 "its stages span nodes")
        elif picked and "devices_per_node" in picked[0]:
            # Prefer the group inside one node: tensor parallelism stays on NVLink.
            best = max(int(r["devices_per_node"]) for r in picked)
            picked = [r for r in picked if int(r["devices_per_node"]) == best]
        pairs = sorted((float(r["size"]), float(r[column]) / 1e3) for r in picked)
    except ValueError as exc:
        raise InputError(path, field, str(path), f"a value is not a number: {exc}") from None
    except TypeError:  # a short row: the csv module gives its missing cells as None
        line = next((i for i, r in enumerate(rows, start=2) if None in r.values()), None)
        raise InputError(path, field, str(path),
                         f"line {line}: a value is missing" if line else "a value is missing"
                         ) from None
    if len(pairs) < 2:
        have = sorted({r["num_workers"] for r in rows}, key=int)
        raise InputError(path, field, str(path), f"has no rows for {num_workers} GPUs "
                                                 f"(num_workers: {', '.join(have)})")
    if any(not (math.isfinite(s) and math.isfinite(t) and s > 0 and t > 0) for s, t in pairs):
        raise InputError(path, field, str(path), "sizes and times must be positive and finite")
    sizes = np.array([s for s, _ in pairs])
    times = _non_decreasing(np.array([t for _, t in pairs]))
    sizes, index = np.unique(sizes, return_index=True)
    times = times[index]
    if len(sizes) < 2:
        raise InputError(path, field, str(path), "needs at least two message sizes")
    start = int(len(sizes) * 0.9)
    start = min(start, len(sizes) - 2)
    slope = (times[-1] - times[start]) / (sizes[-1] - sizes[start])
    return MessageTable(sizes, times, max(float(slope), 0.0))


def _non_decreasing(y: Array) -> Array:
    """The least-squares non-decreasing fit of `y` (pool adjacent violators)."""
    values: list[float] = []
    weights: list[int] = []
    for v in y.tolist():
        values.append(v)
        weights.append(1)
        while len(values) > 1 and values[-2] > values[-1]:
            w = weights[-2] + weights[-1]
            values[-2] = (values[-2] * weights[-2] + values[-1] * weights[-1]) / w
            weights[-2] = w
            values.pop()
            weights.pop()
    return np.repeat(values, weights)


@dataclass(frozen=True)
class BandwidthCollectives:
    """Ring all-reduce and point-to-point times from a link's bandwidth and a start-up."""

    bandwidth_bytes_s: float
    efficiency: float
    all_reduce_latency_s: float
    send_recv_latency_s: float

    def all_reduce_s(self, num_bytes: Array, num_gpus: int) -> Array:
        x = np.asarray(num_bytes, dtype=np.float64)
        moved = 2 * (num_gpus - 1) / num_gpus * x
        t = self.all_reduce_latency_s + moved / (self.bandwidth_bytes_s * self.efficiency)
        return np.where(x > 0, t, 0.0)

    def all_gather_s(self, num_bytes: Array, num_gpus: int) -> Array:
        """Seconds to gather `num_bytes` in all (each GPU contributing 1/num_gpus) by a ring;
        also a gather to one GPU, which receives the same (n-1)/n of them."""
        x = np.asarray(num_bytes, dtype=np.float64)
        moved = (num_gpus - 1) / num_gpus * x
        t = self.all_reduce_latency_s + moved / (self.bandwidth_bytes_s * self.efficiency)
        return np.where(x > 0, t, 0.0)

    def send_recv_s(self, num_bytes: Array) -> Array:
        x = np.asarray(num_bytes, dtype=np.float64)
        t = self.send_recv_latency_s + x / (self.bandwidth_bytes_s * self.efficiency)
        return np.where(x > 0, t, 0.0)


@dataclass(frozen=True)
class CustomAllReduce:
    """vLLM's custom all-reduce kernel (see the module's docstring): seconds for the messages
    it takes, NaN for those it leaves to NCCL."""

    one_stage_latency_s: float = 6e-6
    one_stage_bytes_s: float = 375e9
    two_stage_latency_s: float = 11.8e-6
    two_stage_bytes_s: float = 212e9
    max_bytes: int = 8 * 2**20

    @staticmethod
    def takes_group(num_gpus: int, interconnect: str) -> bool:
        """Whether vLLM uses the kernel at all for this group (`should_custom_ar`: 2, 4, 6 or
        8 GPUs; over 2, peer access suffices, but it is modelled on NVLink only here)."""
        return num_gpus in (2, 4, 6, 8) and interconnect.startswith("nvlink")

    def all_reduce_s(self, num_bytes: Array, num_gpus: int) -> Array:
        x = np.asarray(num_bytes, dtype=np.float64)
        # The buffer vLLM gives it where symmetric memory is on (`CUSTOM_ALL_REDUCE_MAX_SIZES`).
        limit = {6: 512 * 2**10, 8: 256 * 2**10}.get(num_gpus, self.max_bytes)
        if num_gpus == 2:
            one = np.ones_like(x, dtype=bool)
        elif num_gpus <= 4:
            one = x < 512 * 2**10
        else:
            one = x < 256 * 2**10
        t1 = self.one_stage_latency_s + (num_gpus - 1) * x / self.one_stage_bytes_s
        t2 = (self.two_stage_latency_s
              + 2 * (num_gpus - 1) / num_gpus * x / self.two_stage_bytes_s)
        t = np.where(one, t1, t2)
        return np.where(x < limit, np.where(x > 0, t, 0.0), np.nan)


class Collectives:
    """The communication of one split replica, as the latency models charge it: measured tables
    where given (`all_reduce_table` read for the tensor group's size when tensor > 1,
    `send_recv_table` for a pair when pipeline > 1), the link's bandwidth otherwise."""

    def __init__(self, bandwidth: BandwidthCollectives, parallelism: Parallelism,
                 all_reduce_table: Path | None = None, send_recv_table: Path | None = None,
                 field_prefix: str = "latency",
                 network: BandwidthCollectives | None = None,
                 custom: CustomAllReduce | None = None) -> None:
        self.num_gpus = parallelism.tensor
        # The engine's own kernel for the messages it takes; NCCL (table or link) for the rest.
        self.custom = custom
        self.bandwidth = bandwidth
        # Pipeline hand-offs: those between nodes go over the network (`network`, the GPU's
        # scale-out NICs, or the table's rows across nodes), the rest over the node's fabric.
        self.num_handoffs = parallelism.pipeline - 1
        self.num_cross_node_handoffs = parallelism.num_cross_node_handoffs
        self.network = network
        self.all_reduce_table: MessageTable | None = None
        self.send_recv_table: MessageTable | None = None
        self.cross_node_table: MessageTable | None = None
        if all_reduce_table is not None and parallelism.tensor > 1:
            self.all_reduce_table = read_table(all_reduce_table, "all_reduce", parallelism.tensor,
                                               f"{field_prefix}.all_reduce_table")
        if send_recv_table is not None and parallelism.pipeline > 1:
            self.send_recv_table = read_table(send_recv_table, "send_recv", 2,
                                              f"{field_prefix}.send_recv_table")
            if self.num_cross_node_handoffs:
                self.cross_node_table = read_table(send_recv_table, "send_recv", 2,
                                                   f"{field_prefix}.send_recv_table",
                                                   cross_node=True)
        if self.num_cross_node_handoffs and self.cross_node_table is None and network is None:
            raise InputError("<scenario>", "gpu.network_bandwidth_bytes_s", None, (
                f"a replica of {parallelism.num_gpus} GPUs spans nodes of {GPUS_PER_NODE}, "
                "and this GPU has no network bandwidth to time the pipeline hand-offs between "
                "them: give gpu.network_bandwidth_bytes_s, or latency.send_recv_table with "
                "rows across nodes"))

    def all_reduce(self, num_bytes: Array) -> Array:
        """Seconds to all-reduce `num_bytes` over the tensor group."""
        if self.all_reduce_table is not None:
            nccl = self.all_reduce_table(num_bytes)
        else:
            nccl = self.bandwidth.all_reduce_s(num_bytes, self.num_gpus)
        if self.custom is None:
            return nccl
        custom = self.custom.all_reduce_s(num_bytes, self.num_gpus)
        return np.where(np.isnan(custom), nccl, custom)

    def all_gather(self, num_bytes: Array) -> Array:
        """Seconds to gather `num_bytes` (the whole result) over the tensor group: always from
        the link's bandwidth, as no measured table holds an all-gather."""
        return self.bandwidth.all_gather_s(num_bytes, self.num_gpus)

    def send_recv(self, num_bytes: Array) -> Array:
        """Seconds to hand `num_bytes` on from one pipeline stage to the next, in one node."""
        if self.send_recv_table is not None:
            return self.send_recv_table(num_bytes)
        return self.bandwidth.send_recv_s(num_bytes)

    def cross_node_send_recv(self, num_bytes: Array) -> Array:
        """Seconds to hand `num_bytes` on to a stage on another node."""
        if self.cross_node_table is not None:
            return self.cross_node_table(num_bytes)
        assert self.network is not None, "checked when built"
        return self.network.send_recv_s(num_bytes)

    def pipeline_handoffs(self, num_bytes: Array) -> Array:
        """Seconds of one iteration's `pipeline - 1` hand-offs of `num_bytes` each: inside a
        node, and between nodes where the stages span them."""
        inside = self.num_handoffs - self.num_cross_node_handoffs
        time = inside * self.send_recv(num_bytes)
        if self.num_cross_node_handoffs:
            time = time + self.num_cross_node_handoffs * self.cross_node_send_recv(num_bytes)
        return time

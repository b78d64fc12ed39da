"""The waiting queues of engines' priority policies: vLLM's (`--scheduling-policy priority`)
and SGLang's (`--enable-priority-scheduling`, `EntryOrderWaiting`).

vLLM keeps it as a heap of requests ordered by (priority, arrival time, request id), lowest
first (`PriorityRequestQueue` in `vllm/v1/core/sched/request_queue.py`, `Request.__lt__` in
`vllm/v1/request.py`): a preempted request goes back into the heap by that order too
(`prepend_request` pushes), not to the front. Its scheduler only peeks and pops the least
request, so a list kept sorted by the same key admits the same requests in the same order.
It offers what `ReplicaState` and the policies use of a FCFS `deque`.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Iterator

from sim.core.request import Request


def priority_key(req: Request) -> tuple[int, float, int]:
    """vLLM's order: lower priority value first, then earlier arrival, then request id."""
    return (req.priority, req.arrival_s, req.request_id)


class PriorityWaiting:
    """Waiting requests sorted by `priority_key`; `append` and `appendleft` both insert in
    order (a new arrival and a preempted request alike)."""

    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: list[Request] = []

    def append(self, req: Request) -> None:
        insort(self._items, req, key=self.key)

    appendleft = append

    def key(self, req: Request) -> tuple[float, ...]:
        """Where `req` goes: the queue is sorted by this."""
        return priority_key(req)

    def popleft(self) -> Request:
        return self._items.pop(0)

    def remove(self, req: Request) -> None:
        self._items.remove(req)

    def __getitem__(self, index: int) -> Request:
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)


class EntryOrderWaiting(PriorityWaiting):
    """SGLang's queue under `--enable-priority-scheduling` with its fcfs policy
    (`SchedulePolicy._sort_by_priority_and_fcfs`): by priority, higher values first (lower
    with `--schedule-low-priority-values-first`), then by when each request entered the
    queue (`wait_queue_entry_time`, stamped again whenever a preempted or retracted request
    goes back: it joins the end of its level)."""

    __slots__ = ("_sign", "_count", "entered")

    def __init__(self, low_first: bool = False) -> None:
        super().__init__()
        self._sign = 1 if low_first else -1
        self._count = 0
        self.entered: dict[int, int] = {}  # request id -> when it last entered (a count)

    def append(self, req: Request) -> None:
        self._count += 1
        self.entered[req.request_id] = self._count
        insort(self._items, req, key=self.key)

    def forget(self, keep: set[int]) -> None:
        """Drop when the requests not in `keep` entered (those that left for good)."""
        self.entered = {k: v for k, v in self.entered.items() if k in keep}

    appendleft = append

    def key(self, req: Request) -> tuple[float, ...]:
        return (req.priority * self._sign, self.entered[req.request_id])

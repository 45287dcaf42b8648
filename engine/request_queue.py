"""V1's scheduling policies as request queues, as vLLM keeps them (``vllm/v1/core/sched/request_queue.py``:
``SchedulingPolicy``, ``FCFSRequestQueue``, ``PriorityRequestQueue``, ``create_request_queue``).

A policy is the order of the waiting queue (``first``: the request to admit next) and the choice of the
preemption victim among the running requests (``victim``); ``SchedulerV1`` asks its queue for both and
names no policy itself. ``REQUEST_QUEUES`` is the one registry of policies: ``engine.config``'s
``SCHEDULING_POLICIES`` (config validation, the CLI's choices, the scenario file's schema, the Playground's
choices) and the app's labels (``label``, ``short``) are read from it. A new policy is a ``RequestQueue``
subclass registered with ``@register``. The paper's (V0) scheduler is FCFS only and keeps its own deque.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from .sequence import Request


class RequestQueue:
    """V1's waiting queue: requests in queue order (arrival; a preempted request goes back to the front),
    with the operations of the ``deque`` the paper's scheduler uses (``append``, ``appendleft``,
    ``popleft``, ``[0]``, iteration, ``len``) plus ``remove`` of any request in O(1). A subclass is a
    policy: ``first()`` (the request to admit next), ``victim(running)`` (the running request to preempt)
    and ``says(req)`` (what an admission or preemption line adds about the request).

    Class attributes: ``name`` (the policy's value in ``EngineConfig.scheduling_policy``, vLLM's
    ``SchedulerConfig.policy``), ``label`` (the app's choice), ``short`` (the policy in a line of text).
    """

    name: ClassVar[str]
    label: ClassVar[str]
    short: ClassVar[str]

    def __init__(self) -> None:
        self._items: OrderedDict[int, Request] = OrderedDict()  # id(request) -> request, in queue order

    # ---------------------------------------------------------------------------------------- policy
    def first(self) -> Request:
        """The waiting request to admit next."""
        raise NotImplementedError

    def victim(self, running: Sequence[Request]) -> Request:
        """The running request to preempt (``running`` in running order, not empty)."""
        raise NotImplementedError

    def says(self, req: Request) -> str:
        """What an admission or preemption line adds after the request id ("" unless the policy used it)."""
        return ""

    # ----------------------------------------------------------------------------------- queue order
    def _pushed(self, req: Request) -> None:
        """``req`` entered the queue (at either end)."""

    def append(self, req: Request) -> None:
        self._items[id(req)] = req
        self._pushed(req)

    def appendleft(self, req: Request) -> None:
        self._items[id(req)] = req
        self._items.move_to_end(id(req), last=False)
        self._pushed(req)

    def popleft(self) -> Request:
        if not self._items:
            raise IndexError("pop from an empty waiting queue")
        return self._items.popitem(last=False)[1]

    def remove(self, req: Request) -> None:
        if self._items.get(id(req)) is not req:
            raise ValueError(f"{req.request_id} is not in the waiting queue")
        del self._items[id(req)]

    def __getitem__(self, index: int) -> Request:
        if index == 0 and self._items:
            return next(iter(self._items.values()))
        return list(self._items.values())[index]

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items.values())

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)


REQUEST_QUEUES: dict[str, type[RequestQueue]] = {}  # policy name -> its queue class, in registration order


def register(cls: type[RequestQueue]) -> type[RequestQueue]:
    """Add a policy to ``REQUEST_QUEUES`` (a class decorator); refuses a name already taken."""
    for attr in ("name", "label", "short"):
        if not isinstance(getattr(cls, attr, None), str) or not getattr(cls, attr):
            raise ValueError(f"{cls.__name__} needs a non-empty class attribute {attr!r}")
    if cls.name in REQUEST_QUEUES:
        raise ValueError(f"scheduling policy {cls.name!r} is already registered ({REQUEST_QUEUES[cls.name].__name__})")
    REQUEST_QUEUES[cls.name] = cls
    return cls


def create_request_queue(policy: str) -> RequestQueue:
    """An empty waiting queue of ``policy`` (vLLM's ``create_request_queue``). Raises ValueError naming an
    unknown policy and the known ones."""
    try:
        return REQUEST_QUEUES[policy]()
    except KeyError:
        raise ValueError(f"unknown scheduling policy {policy!r}; known: {', '.join(REQUEST_QUEUES)}") from None


@register
class FCFSRequestQueue(RequestQueue):
    """First come, first served: the queue's head is admitted next; the last admitted running request is the
    victim."""

    name = "fcfs"
    label = "FCFS (first come, first served)"
    short = "FCFS"

    def first(self) -> Request:
        return self[0]

    def victim(self, running: Sequence[Request]) -> Request:
        return running[-1]


def priority_key(req: Request) -> tuple:
    """vLLM's ``Request.__lt__`` in its priority heap: (priority, arrival), then the request id (the child
    requests of one ``n > 1`` request share its arrival; as strings: "R1.10" before "R1.2")."""
    return req.priority, req.arrival, req.request_id


@register
class PriorityRequestQueue(RequestQueue):
    """Lowest ``priority`` value first, then arrival (``priority_key``), found in O(log n) by a heap with lazy
    deletion (vLLM's ``PriorityRequestQueue`` is a heap too), so admitting a request costs the same with
    40,000 waiting as with 4. The victim is the running request of the highest (priority, arrival), the first
    in running order among ties (vLLM: ``max(self.running, key=...)``)."""

    name = "priority"
    label = "priority (lower value first)"
    short = "priority scheduling"

    def __init__(self) -> None:
        super().__init__()
        self._heap: list[tuple] = []  # (key, push number, request); stale once removed or pushed again
        self._live: dict[int, int] = {}  # id(request) -> its current heap entry's push number
        self._pushes = 0

    def _pushed(self, req: Request) -> None:
        self._pushes += 1
        self._live[id(req)] = self._pushes
        heapq.heappush(self._heap, (priority_key(req), self._pushes, req))
        if len(self._heap) > 2 * len(self._items) + 64:  # mostly stale entries: rebuild from the queue
            self._heap = [entry for entry in self._heap if self._is_live(entry)]
            heapq.heapify(self._heap)

    def _is_live(self, entry: tuple) -> bool:
        _, number, req = entry
        return self._items.get(id(req)) is req and self._live.get(id(req)) == number

    def first(self) -> Request:
        while not self._is_live(self._heap[0]):
            heapq.heappop(self._heap)
        return self._heap[0][2]

    def victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=lambda r: (r.priority, r.arrival))

    def says(self, req: Request) -> str:
        return f" (priority {req.priority})"

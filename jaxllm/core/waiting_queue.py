"""The scheduler's waiting queue: first come first served between parent requests, round-robin
between the children of each.

A request with n > 1 becomes n child requests, added back to back (EngineCore.add_request). In a
plain FIFO (vLLM's, strict FCFS) they all queue ahead of any request that arrives after them, so
one n=128 request makes a later single request wait for 128 admissions. Here the children of a
parent wait in one group, and the queue is a ring of groups in their parents' arrival order:
admitting takes the first request of the head group and moves the rest of that group to the
back. Parents are thus served in arrival order, one child each per turn, a parent's children
keep their order (the later ones still find the first one's prompt blocks), and a single request
that arrived after an n=128 one goes right after its first child. A preempted request goes back
to the head on its own, ahead of everything waiting (as vLLM). Admission is O(1).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

from jaxllm.core.request import Request

Group = deque[Request]  # waiting children of one parent, in order


class WaitingQueue:
    def __init__(self) -> None:
        self._groups: deque[Group] = deque()  # head first; never an empty group
        self._num_requests = 0

    def __len__(self) -> int:
        return self._num_requests

    def __iter__(self) -> Iterator[Request]:
        """Group by group from the head: each group's first request comes in admission order,
        the rest of a group later than shown."""
        for group in self._groups:
            yield from group

    def append(self, request: Request) -> None:
        """A new request: its siblings arrive back to back, so it joins the last group when that
        is its parent's, else starts a group at the back."""
        groups = self._groups
        if groups and groups[-1][0].parent_request_id == request.parent_request_id:
            groups[-1].append(request)
        else:
            groups.append(deque((request,)))
        self._num_requests += 1

    def appendleft(self, request: Request) -> None:
        """A preempted request: first to be admitted again."""
        self._groups.appendleft(deque((request,)))
        self._num_requests += 1

    def first(self) -> Request:
        return self._groups[0][0]

    def popleft(self) -> Request:
        """Takes the first request (it is admitted); the rest of its group waits for its next
        turn at the back."""
        group = self._groups.popleft()
        request = group.popleft()
        if group:
            self._groups.append(group)
        self._num_requests -= 1
        return request

    def popleft_group(self) -> Group:
        """Takes the head group out whole (a parent that cannot be admitted this step), to be
        put back with extendleft_groups."""
        group = self._groups.popleft()
        self._num_requests -= len(group)
        return group

    def extendleft_groups(self, groups: Iterable[Group]) -> None:
        """Puts groups back at the head, in the order given."""
        groups = list(groups)
        self._groups.extendleft(reversed(groups))
        self._num_requests += sum(map(len, groups))

    def remove(self, request: Request) -> None:
        """Takes out a request that leaves while waiting (abort, or a stop found late)."""
        for index, group in enumerate(self._groups):
            if group[0].parent_request_id == request.parent_request_id and request in group:
                group.remove(request)
                if not group:
                    del self._groups[index]
                self._num_requests -= 1
                return
        raise ValueError(f"Request {request.request_id!r} is not waiting.")

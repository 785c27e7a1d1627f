"""Weighted fair order for waiting requests, by tokens served (virtual time).

Each user (an API key, or the request's `user` field, or the client address) has a virtual
time: tokens the engine computed for it divided by its weight. The next request admitted
comes from the waiting user with the lowest virtual time, so one user flooding the queue
cannot starve the others; within a user, arrival order. A user who becomes active starts at
the lowest virtual time among active users, so idle time is not banked as credit (as in
fair queueing and Linux's CFS). Pure Python, no torch.

Bounded: a user's entries go when the user is idle (nothing waiting, nothing running) and
its virtual time is at or below the floor an arrival would get anyway (it carries nothing);
idle users still in debt are kept, at most MAX_IDLE_USERS of them (the least in debt go
first), so a flood of distinct `user` values cannot grow this without end.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

from pagedllm.core.request import Request

DEFAULT_USER = ""
MAX_IDLE_USERS = 1024  # idle users whose virtual time is kept (their debt)


class FairQueue:
    def __init__(self):
        self._queues: dict[str, deque[Request]] = {}
        self.virtual_time: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.num_running: dict[str, int] = {}  # maintained by the scheduler

    @staticmethod
    def user_of(request: Request) -> str:
        return request.user or DEFAULT_USER

    def weight(self, user: str) -> float:
        return self.weights.get(user, 1.0)

    def _activate(self, user: str) -> None:
        """Start a newly active user at the current minimum virtual time."""
        active = [self.virtual_time.get(u, 0.0) for u in self._active_users() if u != user]
        floor = min(active, default=self.virtual_time.get(user, 0.0))
        self.virtual_time[user] = max(self.virtual_time.get(user, 0.0), floor)

    def _active_users(self) -> set[str]:
        return {u for u, q in self._queues.items() if q} | {u for u, n in self.num_running.items() if n}

    # -- queue operations -----------------------------------------------------------------
    def append(self, request: Request) -> None:
        user = self.user_of(request)
        if user not in self._active_users():
            self._activate(user)
        self._queues.setdefault(user, deque()).append(request)

    def appendleft(self, request: Request) -> None:
        """A preempted request goes back to the front of its user's queue."""
        self._queues.setdefault(self.user_of(request), deque()).appendleft(request)

    def remove(self, request: Request) -> None:
        user = self.user_of(request)
        self._queues[user].remove(request)
        self._forget_if_idle(user)

    def peek(self, can_run: Callable[[str], bool] = lambda user: True,
             can_admit: Callable[[Request], bool] = lambda request: True) -> Request | None:
        """The request to admit next: head of the lowest-virtual-time user allowed to run,
        whose head can be admitted now (its adapter has a slot)."""
        best = None
        for user, queue in self._queues.items():
            if not queue or not can_run(user) or not can_admit(queue[0]):
                continue
            key = (self.virtual_time.get(user, 0.0), queue[0].arrival_time)
            if best is None or key < best[0]:
                best = (key, queue[0])
        return best[1] if best else None

    def pop(self, request: Request) -> None:
        user = self.user_of(request)
        queue = self._queues[user]
        assert queue[0] is request
        queue.popleft()
        self._forget_if_idle(user)

    def count_running(self, user: str, delta: int) -> None:
        """The scheduler's count of a user's running requests."""
        self.num_running[user] = self.num_running.get(user, 0) + delta
        if self.num_running[user] <= 0:
            self._forget_if_idle(user)

    def _forget_if_idle(self, user: str) -> None:
        if self._queues.get(user) or self.num_running.get(user, 0) > 0:
            return
        self._queues.pop(user, None)
        self.num_running.pop(user, None)
        active = [self.virtual_time.get(u, 0.0) for u in self._active_users()]
        floor = min(active, default=None)
        if floor is None or self.virtual_time.get(user, 0.0) <= floor:
            self.virtual_time.pop(user, None)
        idle = [u for u in self.virtual_time if u not in self._queues and u not in self.num_running]
        if len(idle) > MAX_IDLE_USERS:
            idle.sort(key=lambda u: self.virtual_time[u])
            for stale in idle[:len(idle) - MAX_IDLE_USERS]:
                del self.virtual_time[stale]

    def tracked_users(self) -> int:
        """Users with any entry here (tests hold the bound)."""
        return len(set(self._queues) | set(self.num_running) | set(self.virtual_time))

    def charge(self, user: str, num_tokens: int) -> None:
        """Account tokens computed for a user in a step."""
        self.virtual_time[user] = self.virtual_time.get(user, 0.0) + num_tokens / self.weight(user)

    # -- views ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __bool__(self) -> bool:
        return any(self._queues.values())

    def waiting_by_user(self) -> dict[str, int]:
        return {u: len(q) for u, q in self._queues.items() if q}

    def ordered(self) -> list[Request]:
        """Waiting requests in the order they would be admitted if nothing else changed:
        each admission charges the user its request's prompt tokens."""
        vt = dict(self.virtual_time)
        heads = {u: list(q) for u, q in self._queues.items() if q}
        order = []
        while heads:
            user = min(heads, key=lambda u: (vt.get(u, 0.0), heads[u][0].arrival_time))
            request = heads[user].pop(0)
            order.append(request)
            vt[user] = vt.get(user, 0.0) + request.num_tokens / self.weight(user)
            if not heads[user]:
                del heads[user]
        return order

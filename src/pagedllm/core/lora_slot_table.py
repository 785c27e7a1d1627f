"""Which LoRA adapter sits in which of the model's slots (pure bookkeeping, no torch).

A step can mix requests for as many adapters as there are slots (--max-loras). A request's
adapter takes a slot when the request is admitted and holds it while the request runs; an
adapter no running request uses stays in its slot (idle) until a slot is wanted for another,
least recently used first, so a busy adapter is never evicted and a popular one is not copied
in again. Adapters are named by their key (name + digest of the weights), so an adapter
unloaded and loaded again under the same name is never mistaken for the old one.
"""
from __future__ import annotations

from collections import OrderedDict


class LoRASlotTable:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.slot_of: dict[str, int] = {}  # resident adapters (in use or idle) -> slot
        self.users: dict[str, int] = {}  # running requests per resident adapter
        self._idle: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self.num_loads = 0  # slots (re)filled: each is one copy of an adapter's weights
        self._unloaded: set[str] = set()  # unloaded while in use: freed on their last release

    def can_acquire(self, key: str) -> bool:
        return key in self.slot_of or len(self.slot_of) < self.num_slots or bool(self._idle)

    def acquire(self, key: str) -> int:
        """A slot for one more running request of `key` (check can_acquire first)."""
        self._unloaded.discard(key)  # (loaded again, with the same weights)
        if key in self.slot_of:
            self._idle.pop(key, None)
        else:
            taken = set(self.slot_of.values())
            free = [s for s in range(self.num_slots) if s not in taken]
            if free:
                slot = free[0]
            else:
                evicted, _ = self._idle.popitem(last=False)
                slot = self.slot_of.pop(evicted)
                del self.users[evicted]
            self.slot_of[key] = slot
            self.users[key] = 0
            self.num_loads += 1
        self.users[key] += 1
        return self.slot_of[key]

    def release(self, key: str) -> None:
        """One running request of `key` ended or was preempted."""
        self.users[key] -= 1
        if self.users[key] == 0:
            self._idle[key] = None
            if key in self._unloaded:
                self.forget(key)

    def forget(self, key: str) -> None:
        """The adapter was unloaded: its slot is free once no request runs with it."""
        if self.users.get(key, 0) > 0:
            self._unloaded.add(key)
        elif key in self.slot_of:
            self._unloaded.discard(key)
            self._idle.pop(key, None)
            del self.slot_of[key], self.users[key]

    def in_use(self) -> dict[str, int]:
        return {key: n for key, n in self.users.items() if n}

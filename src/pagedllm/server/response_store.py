"""The Responses API's memory: finished responses kept so a later request can continue one
(`previous_response_id`) or read it back (GET /v1/responses/{id}). Bounded three ways: an
entry lives at most TTL_SECONDS, at most MAX_RESPONSES are kept, and their conversations
hold at most MAX_BYTES of text; past a bound the oldest go first. Each entry belongs to
whoever made it (their API key, else their `user` or address): nobody else can read or
continue it. Pure Python; only the event loop touches it."""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

TTL_SECONDS = 3600.0
MAX_RESPONSES = 1024
MAX_BYTES = 64 << 20


@dataclass(frozen=True)
class StoredResponse:
    owner: str
    conversation: tuple[dict, ...]  # every turn so far, the answer's last
    body: dict  # the response object as it was answered
    size: int
    stored_at: float


def conversation_size(conversation) -> int:
    """Characters of text the turns hold (the store's byte bound counts these)."""
    total = 0
    for turn in conversation:
        total += len(turn.get("content") or "")
        for call in turn.get("tool_calls") or ():
            total += len(str(call.get("arguments"))) + len(call.get("name") or "")
    return total


class ResponseStore:
    def __init__(self, ttl: float = TTL_SECONDS, max_responses: int = MAX_RESPONSES,
                 max_bytes: int = MAX_BYTES, clock=time.monotonic):
        self.ttl, self.max_responses, self.max_bytes = ttl, max_responses, max_bytes
        self.clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, owner: str, conversation: list[dict], body: dict) -> None:
        size = conversation_size(conversation)
        if size > self.max_bytes:
            return  # larger than the whole store: not kept (a later lookup says so)
        self._drop(response_id)
        self._entries[response_id] = StoredResponse(owner, tuple(conversation), body, size,
                                                    self.clock())
        self.bytes += size
        self._expire()
        while len(self._entries) > self.max_responses or self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """The entry, when it exists, has not expired and belongs to `owner`."""
        self._expire()
        entry = self._entries.get(response_id)
        return entry if entry is not None and entry.owner == owner else None

    def delete(self, response_id: str, owner: str) -> bool:
        if self.get(response_id, owner) is None:
            return False
        self._drop(response_id)
        return True

    def _expire(self) -> None:
        horizon = self.clock() - self.ttl
        while self._entries:
            oldest_id, oldest = next(iter(self._entries.items()))
            if oldest.stored_at >= horizon:
                break
            self._drop(oldest_id)

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.size

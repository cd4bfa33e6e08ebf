"""A bounded in-memory store of finished Responses (`store`, `previous_response_id`, `GET /v1/responses/{id}`).

Least recently stored or read responses are dropped first once `capacity` is reached; capacity 0 turns the
store off. It lives for the server process only (one app instance owns one store).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object as returned
    items: list[dict[str, Any]]  # the conversation it continued (input items, no instructions) plus its output
    input_count: int  # how many of `items` were its input (`GET /v1/responses/{id}/input_items`)


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"responses store capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if not self.enabled:
            return
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None

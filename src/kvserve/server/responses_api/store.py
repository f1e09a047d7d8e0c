"""Stored responses: what `previous_response_id` continues and `GET /v1/responses/{id}` returns.

Keyed by (tenant, response id): a tenant can neither continue nor read another tenant's response (it is
simply not found, as an unknown id is). Bounded by count and by the characters of the histories it holds;
the least recently used go first. In memory, per server: a restart (or another replica) does not have
them, so `previous_response_id` there is a 404 naming it, and the client resends the conversation.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

DEFAULT_MAX_RESPONSES = 4096
DEFAULT_MAX_CHARS = 64 * 2**20


@dataclass(slots=True)
class StoredResponse:
    history: list[dict[str, Any]]  # the conversation as chat messages, this response's output included
    response: dict[str, Any]  # the Response object as returned
    chars: int


@dataclass(slots=True)
class ResponseStore:
    max_responses: int = DEFAULT_MAX_RESPONSES
    max_chars: int = DEFAULT_MAX_CHARS
    _items: OrderedDict[tuple[str | None, str], StoredResponse] = field(default_factory=OrderedDict)
    _chars: int = 0

    def __post_init__(self) -> None:
        if self.max_responses < 1 or self.max_chars < 1:
            raise ValueError("a response store needs room for at least one response")

    def put(self, tenant: str | None, response: dict[str, Any], history: list[dict[str, Any]]) -> None:
        chars = sum(len(str(message.get("content") or "")) + len(str(message.get("tool_calls") or ""))
                    for message in history)
        key = (tenant, response["id"])
        self.delete(tenant, response["id"])
        self._items[key] = StoredResponse(history, response, chars)
        self._chars += chars
        while len(self._items) > self.max_responses or (self._chars > self.max_chars and len(self._items) > 1):
            _, dropped = self._items.popitem(last=False)
            self._chars -= dropped.chars

    def get(self, tenant: str | None, response_id: str) -> StoredResponse | None:
        item = self._items.get((tenant, response_id))
        if item is not None:
            self._items.move_to_end((tenant, response_id))
        return item

    def delete(self, tenant: str | None, response_id: str) -> bool:
        item = self._items.pop((tenant, response_id), None)
        if item is None:
            return False
        self._chars -= item.chars
        return True

    def __len__(self) -> int:
        return len(self._items)

    @property
    def chars(self) -> int:
        return self._chars


class ResponseStoreCollector(Collector):
    """`kvserve_responses_stored` and `kvserve_responses_stored_chars` at scrape time: what the store holds
    (summed over tenants: a count reveals nothing of any one tenant's traffic beyond the total)."""

    def __init__(self, store: ResponseStore, model_name: str) -> None:
        self._store = store
        self._model = model_name

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for name, documentation, value in (
            ("kvserve_responses_stored", "Responses kept for previous_response_id (kvserve).", len(self._store)),
            ("kvserve_responses_stored_chars", "Characters of conversation history they hold (kvserve).",
             self._store.chars),
        ):
            family = GaugeMetricFamily(name, documentation, labels=["model_name"])
            family.add_metric([self._model], value)
            yield family

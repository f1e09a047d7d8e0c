"""Where requests must or should go whatever the policy says: the worker that holds a stored response (so
`previous_response_id` reaches it), and the worker a `prompt_cache_key` last went to.

A worker keeps the responses it created (`/v1/responses`, server/responses_api/store.py) in its own
memory: a continuation sent anywhere else would be a 404. The router learns each new response's id from
the answer passing through it (the JSON body, or the stream's first event, `response.created`, which
carries it) and sends a request that continues it to the same worker, whatever the policy would have
chosen: the conversation's prefix is cached there too. Bounded, least recently used first; an id the
router never saw (or whose worker left the pool) goes where the policy says, and that worker answers.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass, field

from kvserve.router.config import BALANCE_ABS
from kvserve.router.workers import Worker

_RESPONSE_ID = re.compile(rb'"id": ?"(resp_[0-9a-f]{32})"')
DEFAULT_MAX_IDS = 65536


@dataclass(slots=True)
class ResponseAffinity:
    max_ids: int = DEFAULT_MAX_IDS
    _where: OrderedDict[str, str] = field(default_factory=OrderedDict)  # response id -> worker URL

    def learn(self, worker: Worker, answer: bytes) -> None:
        """Remember where the response named first in `answer` (a body, or a stream's first bytes) lives."""
        match = _RESPONSE_ID.search(answer)
        if match is None:
            return
        self._where[match.group(1).decode()] = worker.url
        self._where.move_to_end(match.group(1).decode())
        while len(self._where) > self.max_ids:
            self._where.popitem(last=False)

    def worker(self, response_id: object, candidates: list[Worker]) -> Worker | None:
        """The candidate holding `response_id`, if the router saw it created there."""
        if not isinstance(response_id, str):
            return None
        url = self._where.get(response_id)
        if url is None:
            return None
        self._where.move_to_end(response_id)
        return next((worker for worker in candidates if worker.url == url), None)

    def forget(self, response_id: str) -> None:
        self._where.pop(response_id, None)

    def __len__(self) -> int:
        return len(self._where)


@dataclass(slots=True)
class CacheKeyAffinity:
    """OpenAI's `prompt_cache_key`: the client's own word that requests share a prefix (an agent's tools and
    instructions, a document), so they go where the last request with that key went -- in the same tenant
    namespace only, so one tenant's key never steers another's requests -- unless that worker has more than
    `slack` requests more than the least busy one (then the policy decides, and the key follows it). It
    matters most where the policy does not look at prompts (round_robin, least_load) or cannot key them
    (a model without a tokenizer); cache-aware policies usually agree with it. Bounded, least recently used
    first."""

    max_keys: int = DEFAULT_MAX_IDS
    slack: int = BALANCE_ABS
    _where: OrderedDict[tuple[tuple[str, ...], str], str] = field(default_factory=OrderedDict)

    def worker(self, key: object, namespace: tuple[str, ...] | None, candidates: list[Worker]) -> Worker | None:
        """The candidate this key's requests went to, if it is not too busy."""
        if not isinstance(key, str) or namespace is None or not candidates:
            return None
        url = self._where.get((namespace, key))
        holder = next((worker for worker in candidates if worker.url == url), None)
        if holder is None or holder.load_score > min(w.load_score for w in candidates) + self.slack:
            return None
        self._where.move_to_end((namespace, key))
        return holder

    def learn(self, key: object, namespace: tuple[str, ...] | None, worker: Worker) -> None:
        if not isinstance(key, str) or namespace is None:
            return
        self._where[(namespace, key)] = worker.url
        self._where.move_to_end((namespace, key))
        while len(self._where) > self.max_keys:
            self._where.popitem(last=False)

    def __len__(self) -> int:
        return len(self._where)

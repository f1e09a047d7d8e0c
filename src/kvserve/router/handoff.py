"""The prefill half of a pd hand-off: the same request, `max_tokens=1`, non-streaming, to a prefill worker.

The prefill worker (`--role prefill`) computes the prompt (and one token, thrown away), waits until its
full blocks are written through to the shared store (bounded by its `--prefill-flush-timeout`) and
says how that went in `x-kvserve-kv-flush`: `ok`, `failed` (a write dropped or failed, the store's
breaker open, the timeout passed) or `off` (no store). Only `ok` makes the hand-off: the decode worker
then finds the blocks in the store at admission. Everything else falls back to mixed serving — the
decode worker computes the prompt itself — and is counted by reason.

The caller's headers (API key) and every other field of the body pass unchanged, so the prefill worker
keys the blocks in the same namespace (tenant, `cache_salt`) as the decode worker will look for them.
A client that leaves during the prefill cancels it (the prefill worker aborts and frees its blocks);
the decode request is then never sent.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import httpx
from fastapi import Request
from fastapi.responses import Response

from kvserve.router.metrics import RouterMetrics
from kvserve.router.proxy import ClientGone, Upstream, WorkerFailed
from kvserve.router.workers import Worker, WorkerPool
from kvserve.server.roles import FLUSH_BYTES_HEADER, FLUSH_HEADER, FLUSH_MS_HEADER

logger = logging.getLogger("kvserve.router")
# Errors in the request itself: the decode worker would answer the same, so the caller gets this one.
_CALLER_ERRORS = {400, 401, 403, 404, 413, 422}
# Body fields that make no sense for a one-token, one-choice, non-streaming prefill.
_DROPPED_FIELDS = ("stream_options", "min_tokens", "best_of", "max_completion_tokens")
LOG_INTERVAL_S = 10.0


@dataclass(frozen=True, slots=True)
class PrefillOutcome:
    """`handed_off`: the decode worker will find the prompt in the store. `answer`: a response for the
    caller (an error in the request, or 499 when the caller left); else `fallback` names why not."""

    handed_off: bool = False
    answer: Response | None = None
    fallback: str | None = None


def prefill_body(parsed: dict) -> bytes:
    """The request as a prefill: one token, one choice, no stream; everything else unchanged."""
    body = {name: value for name, value in parsed.items() if name not in _DROPPED_FIELDS}
    body.update(max_tokens=1, stream=False, n=1)
    if body.get("use_beam_search"):
        body["use_beam_search"] = False
    return json.dumps(body).encode()


def copy_request(parsed: dict, headers: dict[str, str]) -> tuple[bytes, dict[str, str]]:
    """A warm or idle copy: the prefill body and headers without the caller's request id (body `request_id`,
    `X-Request-Id`). The copy is not the caller's request, and a caller reusing its id on the copy's worker
    while the copy runs there would be refused as a duplicate."""
    body = prefill_body({name: value for name, value in parsed.items() if name != "request_id"})
    return body, {name: value for name, value in headers.items() if name.lower() != "x-request-id"}


async def run_prefill(
    request: Request, client: httpx.AsyncClient, pool: WorkerPool, fallbacks: FallbackLog, worker: Worker,
    path: str, parsed: dict, headers: dict[str, str],
) -> PrefillOutcome:
    metrics = fallbacks.metrics
    started = time.perf_counter()
    upstream = Upstream(client, worker, path, prefill_body(parsed), headers, metrics)
    try:
        answer = await upstream.unary(request)
    except ClientGone:
        metrics.routed.labels(worker.url, "client_gone").inc()
        return PrefillOutcome(answer=Response(status_code=499))
    except WorkerFailed as err:
        pool.mark_down(worker, str(err))
        metrics.routed.labels(worker.url, "failed").inc()
        return fallbacks.record("prefill_failed", f"prefill worker {worker.url} failed: {err}")
    metrics.routed.labels(worker.url, "ok" if answer.status_code == 200 else str(answer.status_code)).inc()
    if answer.status_code in _CALLER_ERRORS:
        return PrefillOutcome(answer=answer)
    if answer.status_code != 200:
        return fallbacks.record("prefill_error", f"prefill worker {worker.url} answered {answer.status_code}")
    flush = answer.headers.get(FLUSH_HEADER, "off")
    if flush != "ok":
        return fallbacks.record("flush_failed", f"prefill worker {worker.url} could not write the prompt's "
                         f"blocks to the store (flush: {flush})")
    metrics.pd_handoffs.inc()
    metrics.pd_prefill_seconds.observe(time.perf_counter() - started)
    metrics.pd_handoff_bytes.inc(_int_header(answer, FLUSH_BYTES_HEADER))
    metrics.pd_flush_seconds.observe(_int_header(answer, FLUSH_MS_HEADER) / 1000)
    return PrefillOutcome(handed_off=True)


class FallbackLog:
    """Counts every fallback; logs a reason at most once per `interval_s` (with how many it folded in),
    so a pool without a store does not write a line per request."""

    def __init__(self, metrics: RouterMetrics, interval_s: float = LOG_INTERVAL_S) -> None:
        self.metrics = metrics
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._folded: dict[str, int] = {}

    def record(self, reason: str, detail: str) -> PrefillOutcome:
        self.metrics.pd_fallbacks.labels(reason).inc()
        now = time.monotonic()
        if now - self._last.get(reason, -self.interval_s) >= self.interval_s:
            folded = self._folded.pop(reason, 0)
            more = f" (and {folded} more since the last line)" if folded else ""
            logger.warning("router: pd fallback to mixed serving (%s): %s%s", reason, detail, more)
            self._last[reason] = now
        else:
            self._folded[reason] = self._folded.get(reason, 0) + 1
        return PrefillOutcome(fallback=reason)


def _int_header(answer: Response, name: str) -> int:
    try:
        return max(int(float(answer.headers.get(name, "0"))), 0)
    except ValueError:
        return 0

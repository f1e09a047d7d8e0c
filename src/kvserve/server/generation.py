"""Running one HTTP request's choices on the engine: admission, collection, and SSE streaming.

Each prompt is one engine request carrying all n of its choices (parallel samples or beams), so the
group iterated here yields `(prompt index, RequestOutput)`; `responses.choices_of` splits each output
into its choices.

Every path ends with `group.abort()`, a no-op once all choices finished: a client that disconnects
(or a handler cancelled at shutdown) aborts its engine requests so their blocks come back at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from fastapi import Request
from pydantic import BaseModel

from kvserve.engine.background import MAX_BACKGROUND_REQUESTS
from kvserve.engine.params import BeamSearchParams, SamplingParams
from kvserve.engine.request import CompletionOutput, RequestOutput
from kvserve.lora.adapter import LoRAAdapter
from kvserve.prefix.namespace import Namespace
from kvserve.server.errors import ApiError, from_engine_value_error
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import Usage
from kvserve.server.responses import ResponseContext, choices_of, usage_of
from kvserve.server.state import ServerState
from kvserve.serving.async_engine import (
    AsyncEngine,
    EngineDeadError,
    RequestFailedError,
    RequestGroup,
    RequestSpec,
)

logger = logging.getLogger("uvicorn.error")  # alongside uvicorn's own lines
SSE_DONE = "data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The caller hung up before its non-streaming response was ready."""


@dataclass(slots=True)
class StreamFormat:
    """How one endpoint turns outputs into SSE chunks."""

    first_chunks: Callable[[ResponseContext], list[BaseModel]]
    chunk: Callable[[ResponseContext, int, CompletionOutput], BaseModel | None]  # (ctx, choice index, ...)
    usage_chunk: Callable[[ResponseContext, Usage], BaseModel] | None  # None: usage not requested
    # before a choice's first chunk (completions' echo: the prompt and its log-probs), given its prompt's output
    choice_opening: Callable[[ResponseContext, int, RequestOutput], BaseModel] | None = None


async def submit(
    state: ServerState, ctx: ResponseContext, prompts: Sequence[list[int]],
    params: SamplingParams | BeamSearchParams, namespace: Namespace, prompt_param: str,
    lora: LoRAAdapter | None = None, priority: int = 0, probe_store: bool = True, background: bool = False,
) -> RequestGroup:
    """Queue one engine request per prompt (each carries its n choices) as one group; 429 when
    `max_queue` requests already wait that cannot start now. `probe_store` False: admission does not ask
    the shared store (a router said it holds nothing more, `server/roles.py` STORE_PROBE_HEADER).
    `background`: a router's idle copy (`engine/background.py`), 429 beyond `MAX_BACKGROUND_REQUESTS`."""
    engine, max_queue = state.engine, state.max_queue
    if background and engine.num_background >= MAX_BACKGROUND_REQUESTS:
        raise ApiError(429, f"{MAX_BACKGROUND_REQUESTS} background requests are queued already; retry later",
                       code="background_full", type_="rate_limit_error")
    if queue_backlog(engine, state.limits.max_num_seqs) >= max_queue:
        raise ApiError(429, f"the server's request queue is full ({max_queue} waiting); retry later",
                       code="queue_full", type_="rate_limit_error")
    specs = [RequestSpec(ids, params, ctx.request_id(p), namespace, lora, priority, probe_store, background)
             for p, ids in enumerate(prompts)]
    try:
        return await engine.add_requests(specs)
    except ValueError as err:
        raise from_engine_value_error(err, prompt_param) from err
    except EngineDeadError as err:
        raise engine_unavailable(err) from err


def queue_backlog(engine: AsyncEngine, max_num_seqs: int | None) -> int:
    """Waiting requests that cannot start now: those beyond the free sequence slots (all of them when
    the slot count is unknown). Just-submitted requests wait until the next step admits them, so
    counting every waiting request would refuse bursts while slots are free."""
    free_slots = 0 if max_num_seqs is None else max(0, max_num_seqs - engine.num_running)
    return engine.num_waiting - free_slots


def engine_unavailable(err: Exception) -> ApiError:
    """503 with a generic message: the cause (an internal exception) goes to the log, not the caller."""
    logger.error("engine unavailable: %s", err)
    return ApiError(503, "the engine is not running; retry later", code="engine_unavailable",
                    type_="server_error")


def request_failed(err: RequestFailedError) -> ApiError:
    """500 for a request that failed inside the engine (the others went on); the message is generic. 400
    when the request caused it (e.g. its token masks left nothing to sample), with the engine's reason."""
    if err.request_fault:
        return ApiError(400, str(err), code="invalid_request", type_="invalid_request_error")
    return ApiError(500, str(err), code="internal_error", type_="internal_error")


async def collect(group: RequestGroup, request: Request, metrics: ServerMetrics) -> dict[int, RequestOutput]:
    """Final output of every prompt; aborts the group if the client disconnects first."""
    collector = asyncio.ensure_future(_final_outputs(group, metrics))
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        collector.cancel()  # no-op when done
        num_aborted = group.abort()
        metrics.observe_aborted(num_aborted, group.request_ids)
    if collector not in done:
        logger.info("client disconnected before its response; %d engine request(s) aborted", num_aborted)
        raise ClientDisconnected
    try:
        return collector.result()
    except EngineDeadError as err:
        raise engine_unavailable(err) from err
    except RequestFailedError as err:
        raise request_failed(err) from err


async def _final_outputs(group: RequestGroup, metrics: ServerMetrics) -> dict[int, RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    async for index, output in group:
        metrics.observe_output(output)
        if output.finished:
            finals[index] = output
    return finals


async def _wait_for_disconnect(request: Request) -> None:
    # After the body is read, the ASGI server's receive() blocks until the client goes away.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def sse_stream(
    group: RequestGroup, ctx: ResponseContext, fmt: StreamFormat, metrics: ServerMetrics
) -> AsyncIterator[str]:
    """Server-sent events for a group: role chunks, per-choice deltas, optional usage, then `[DONE]`.

    The role chunks go out with the first output, not before it: a router (`router/proxy.py`) takes a
    stream's first bytes as "the prompt is computed" (its pending-prefill count, the worker's prefill
    speed, cache_aware's record of what the store holds), and a role chunk sent at once made every chat
    stream look prefilled the moment it was accepted.

    A parallel request reports all its samples after every step, so a choice that already finished
    is skipped afterwards; beam search reports once, at the end: one whole chunk per choice.
    """
    latest: dict[int, RequestOutput] = {}
    finished_choices: set[int] = set()
    opened_choices: set[int] = set()
    announced = False
    try:
        async for prompt_index, output in group:
            if not announced:  # with the first output, as vLLM does: the first bytes mean the prompt is computed
                announced = True
                for chunk in fmt.first_chunks(ctx):
                    yield _event(chunk)
            latest[prompt_index] = output
            metrics.observe_output(output)
            for index, completion in choices_of(ctx, prompt_index, output):
                if index in finished_choices:
                    continue
                if completion.finish_reason is not None:
                    finished_choices.add(index)
                if fmt.choice_opening is not None and index not in opened_choices:
                    opened_choices.add(index)
                    yield _event(fmt.choice_opening(ctx, index, output))
                chunk = fmt.chunk(ctx, index, completion)
                if chunk is not None:
                    yield _event(chunk)
        if fmt.usage_chunk is not None:
            yield _event(fmt.usage_chunk(ctx, usage_of(ctx, latest)))
        yield SSE_DONE
    except EngineDeadError as err:
        # Headers are out already: report in-band, as OpenAI does for mid-stream errors.
        yield f"data: {json.dumps(engine_unavailable(err).body())}\n\n"
        yield SSE_DONE
    except RequestFailedError as err:
        yield f"data: {json.dumps(request_failed(err).body())}\n\n"
        yield SSE_DONE
    finally:
        num_aborted = group.abort()
        if num_aborted:  # the client hung up (or the server is stopping): one line, no traceback
            logger.info("%s: stream closed before the end; %d engine request(s) aborted", ctx.id, num_aborted)
        metrics.observe_aborted(num_aborted, group.request_ids)


def _event(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"

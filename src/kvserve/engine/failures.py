"""Failure stays with its request: per-group guards for the work of one step, and when to give up.

An exception while running, sampling, detokenizing or deciding for a request is that request's
failure, not the engine's: the engine records it against the request's group (`StepFailures.guard`),
aborts the whole group (every member, its blocks released) and reports a final output whose `error` is
a generic message naming the request id. The details (the traceback) go to the log only, never to the
caller. Everyone else in the step goes on.

What cannot be attributed to a request -- scheduling, the copy-on-write block copies, the end-of-step
invariant checks -- propagates out of `LLMEngine.step()`: the engine loop cannot go on, and its owner
(the async engine, then the server) must stop the process. So must a run of steps in which every
scheduled group failed (`MAX_ALL_FAILED_STEPS`): one bad request fails alone, a broken engine fails
everyone, step after step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import torch

from kvserve.engine.request import Request, RequestError, RequestOutput

if TYPE_CHECKING:
    from kvserve.engine.scheduler import ScheduledRequest

    Forward = Callable[[list[ScheduledRequest]], tuple[torch.Tensor, list[ScheduledRequest]]]

logger = logging.getLogger(__name__)
T = TypeVar("T")
MAX_ALL_FAILED_STEPS = 5  # consecutive steps where every scheduled group failed -> the engine is broken


class EngineLoopError(RuntimeError):
    """The engine cannot go on: failures no longer stay with single requests."""


def internal_error_message(request_id: str) -> str:
    """What the caller of a failed request is told (details stay in the log)."""
    return f"internal error while generating (request id {request_id})"


@dataclass(slots=True)
class StepFailures:
    """The groups that failed during one step, with the exception each raised first."""

    errors: dict[str, BaseException] = field(default_factory=dict)

    def __contains__(self, group_id: str) -> bool:
        return group_id in self.errors

    def guard(self, group_id: str, fn: Callable[[], T]) -> T | None:
        """Run `fn` as work of `group_id`; an exception marks the group failed (logged) and returns None.
        A group that already failed this step does nothing more."""
        if group_id in self.errors:
            return None
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - a request's failure must not reach the others
            self.fail(group_id, exc)
            return None

    def fail(self, group_id: str, exc: BaseException) -> None:
        if group_id in self.errors:
            return
        logger.error("request %s failed; aborting it", group_id, exc_info=exc)
        self.errors[group_id] = exc


@dataclass(slots=True)
class FailureStreak:
    """Counts consecutive steps in which every scheduled group failed."""

    limit: int = MAX_ALL_FAILED_STEPS
    count: int = 0

    def record(self, num_groups: int, num_failed: int) -> None:
        """After a step; raises EngineLoopError once `limit` steps in a row failed every group."""
        if num_groups == 0 or num_failed < num_groups:
            self.count = 0
            return
        self.count += 1
        if self.count >= self.limit:
            raise EngineLoopError(f"{self.count} consecutive steps failed every request they ran")


def failed_output(root: Request, error: BaseException | None = None) -> RequestOutput:
    """The final output of a failed group: no completions, finish reason "error", a generic message (the
    error's own for a RequestError)."""
    own = isinstance(error, RequestError)
    message = str(error) if own else internal_error_message(root.request_id)
    return RequestOutput(
        request_id=root.request_id, prompt=root.prompt, prompt_token_ids=root.prompt_token_ids,
        text="", token_ids=[], finished=True, finish_reason="error",
        num_cached_tokens=root.num_cached_tokens, metrics=root.metrics, error=message,
        error_is_request_fault=own,
    )


def run_attributed(forward: Forward, scheduled: list[ScheduledRequest], failures: StepFailures
                   ) -> tuple[torch.Tensor, list[ScheduledRequest]]:
    """The batched forward; if it raises, each group's part is run alone, and only the groups whose own
    forward raises fail (K/V slots written twice get the same values)."""
    try:
        return forward(scheduled)
    except Exception as exc:  # noqa: BLE001 - attributed below, group by group
        by_group: dict[str, list[ScheduledRequest]] = {}
        for item in scheduled:
            by_group.setdefault(item.request.group_id, []).append(item)
        if len(by_group) == 1:
            failures.fail(next(iter(by_group)), exc)
            return torch.empty(0), []
        logger.warning("batched forward failed (%r); running its %d requests one by one", exc, len(by_group))
    parts = [failures.guard(group_id, lambda items=items: forward(items)) for group_id, items in by_group.items()]
    parts = [part for part in parts if part is not None and part[1]]
    if not parts:
        return torch.empty(0), []
    return torch.cat([logits for logits, _ in parts]), [item for _, items in parts for item in items]

"""Forking a sequence: a new member of a group that starts as a copy of another member's history.

This copies the request state only (tokens, progress counters for reporting, log-probs). The KV
side is the block manager's (`BlockManager.fork`: one more reference to each of the parent's blocks,
the partly filled tail copied on its first write), and where the fork runs is the scheduler's
(`Scheduler.add_fork`). So n forks of a prompt hold its blocks once plus at most n - 1 tail copies.
"""

from __future__ import annotations

from kvserve.engine.request import Request, RequestMetrics


def fork_sequence(parent: Request, child_id: str) -> Request:
    """A copy of `parent`'s history (tokens, log-probs, cumulative log-prob) in the same group; no blocks."""
    child = Request(
        child_id, parent.prompt_token_ids, parent.params, namespace=parent.namespace, prompt=parent.prompt,
        eos_token_ids=parent.eos_token_ids, group_id=parent.group_id,
        metrics=RequestMetrics(parent.metrics.arrival_time, parent.metrics.first_scheduled_time),
        lora=parent.lora, priority=parent.priority,
    )
    child.output_token_ids = list(parent.output_token_ids)
    child.all_token_ids = list(parent.all_token_ids)
    child.num_cached_tokens = parent.num_cached_tokens
    child.cached_tokens_by_source = dict(parent.cached_tokens_by_source)
    child.num_preemptions = parent.num_preemptions  # a resumed parent's child re-matches as "preempted"
    child.cumulative_logprob = parent.cumulative_logprob
    child.logprobs = None if parent.logprobs is None else list(parent.logprobs)
    child.prompt_logprobs = None if parent.prompt_logprobs is None else list(parent.prompt_logprobs)
    child.grammar = None if parent.grammar is None else parent.grammar.fork(parent.output_token_ids)
    return child

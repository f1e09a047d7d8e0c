"""Fair-share limits: what one request may hold of the pool, and of a step's token budget.

`max_blocks_per_request` refuses, at admission, a request whose worst case (every sequence of its group:
n / best_of samples or beams) would need more blocks than the cap, so one client cannot take the pool
hostage; by default a request may need half the pool, or one full-length sequence if that is more.
`long_prefill_token_threshold` bounds the prompt tokens one request computes per step
(`Scheduler._chunk`), and `max_admitted_prefill_tokens` those a step admits from the queue (`joins_step`).
"""

from __future__ import annotations

from kvserve.engine.block_manager import BlockManager
from kvserve.engine.params import BeamSearchParams, SamplingParams

LONG_PREFILL_MIN_TOKENS = 64
LONG_PREFILL_PERCENT = 4  # vLLM's default when it splits long prefills (4% of max_model_len)


SHORT_ADMISSION_TOKENS = 64  # a prompt this short joins a step past the admission cap (`joins_step`)


def joins_step(cap: int, admitted: int, num_new: int) -> bool:
    """Whether a waiting prompt computing `num_new` tokens joins a step that has admitted `admitted` prompt
    tokens so far, under the admission cap (`max_admitted_prefill_tokens`, applied while others wait or
    run; 0: off). The first newcomer always joins; later ones while the step's admitted tokens stay within
    the cap, so prompts that queued together answer one after another: without it two 240-token chat turns
    that arrived during a third's prefill were computed in one step and the first answered only after the
    second's prefill too. A prompt of at most `SHORT_ADMISSION_TOKENS` joins regardless: its compute is about
    a step's fixed cost, and holding short prompts for the next step cost a saturated server 19% of its
    capacity (`benchmarks/soak.py --quick`, benchmarks/results/router_admission_zen4.md)."""
    return not cap or not admitted or admitted + num_new <= cap or num_new <= SHORT_ADMISSION_TOKENS


def default_long_prefill_threshold(max_model_len: int) -> int:
    """Prompt tokens per step of one request while others share the step (see `Scheduler._chunk`)."""
    return max(LONG_PREFILL_MIN_TOKENS, max_model_len * LONG_PREFILL_PERCENT // 100)


def num_group_sequences(params: SamplingParams | BeamSearchParams) -> int:
    """Sequences a request runs at most at once: best_of samples, or beam_width beams."""
    if isinstance(params, BeamSearchParams):
        return params.beam_width
    return params.num_samples


def worst_case_blocks(num_prompt_tokens: int, max_tokens: int, num_sequences: int, block_size: int) -> int:
    """Blocks a group may hold at once: the prompt's full blocks once (shared), every sequence its own
    rest (the prompt's partial tail copied on write, and its output)."""
    shared = num_prompt_tokens // block_size
    per_sequence = -(-(num_prompt_tokens + max_tokens) // block_size) - shared
    return shared + num_sequences * per_sequence


def default_block_cap(num_blocks: int, max_model_len: int, block_size: int) -> int:
    """Half the pool, or one full-length sequence if that is more: any one sequence is admitted as
    before (it must fit the pool, `_check_fits`); a group may need one full context's worth of blocks
    or half the pool. On a pool smaller than one context a group may exceed the pool: its members then
    take turns (fair preemption and admission keep it from holding the others hostage)."""
    return max(num_blocks // 2, -(-max_model_len // block_size))


def check_block_cap(
    num_prompt_tokens: int, params: SamplingParams | BeamSearchParams, block_manager: BlockManager,
    cap: int | None, max_model_len: int,
) -> None:
    """ValueError naming `max_blocks_per_request` when the request's worst case exceeds the cap."""
    num_sequences = num_group_sequences(params)
    needed = worst_case_blocks(num_prompt_tokens, params.max_tokens, num_sequences, block_manager.block_size)
    if cap is None:
        cap = default_block_cap(block_manager.num_blocks, max_model_len, block_manager.block_size)
    if needed > cap:
        raise ValueError(
            f"request needs up to {needed} KV blocks ({num_sequences} sequences of up to "
            f"{num_prompt_tokens + params.max_tokens} tokens, prompt blocks shared) but "
            f"max_blocks_per_request is {cap}; lower max_tokens, n, best_of or the beam width"
        )

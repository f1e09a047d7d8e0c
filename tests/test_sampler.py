"""The sampler's random draws and filters (engine/sampler.py) against their definitions: the inverse-CDF
draw follows the distribution and never picks a token of zero probability; the top-k and top-p filters
equal the full-sort rules they replace (top-p's candidate path and its fallback, ties, rows that need no
filter); a seeded draw depends only on its generator; greedy rows take the first maximal token."""

from __future__ import annotations

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvserve.engine import sampler
from kvserve.engine.params import SamplingParams


def _sorted_top_p(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """The rule on the whole sorted vocabulary (the implementation before candidates)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(mass_before >= top_ps.unsqueeze(1), 0))


def _sorted_top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    vocab = logits.shape[-1]
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks])
    kth = logits.sort(dim=-1, descending=True).values.gather(1, (ks - 1).unsqueeze(1))
    return logits.masked_fill(logits < kth, float("-inf"))


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 5), vocab=st.sampled_from([7, 1024, 1500, 5000]), spread=st.floats(0.01, 8.0),
       top_p=st.floats(0.05, 0.999), seed=st.integers(0, 2**16))
@example(rows=3, vocab=5000, spread=0.05078125, top_p=0.05, seed=285)  # a tie at the boundary (CI, 2026-12-03)
def test_top_p_equals_the_full_sort(rows, vocab, spread, top_p, seed):
    """Peaked rows (the nucleus within the candidates) and flat ones (the fallback), mixed in one call."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * torch.linspace(0.01, spread, rows).unsqueeze(1)
    probs = logits.softmax(dim=-1)
    top_ps = torch.full((rows,), top_p)
    _assert_same_nucleus(probs, sampler._apply_top_p(probs, top_ps), _sorted_top_p(probs, top_ps))


def _assert_same_nucleus(probs: torch.Tensor, got: torch.Tensor, want: torch.Tensor) -> None:
    """The same kept values; tokens may differ only where equal probabilities tie at the boundary (topk and
    sort break ties differently: seed 285 of the test above, two tokens of 0.00021024681 at the cut)."""
    assert torch.equal(got.sort(dim=-1).values, want.sort(dim=-1).values)
    for row in (got != want).any(dim=-1).nonzero().flatten().tolist():
        differ = (got[row] != want[row]).nonzero().flatten()
        boundary = want[row][want[row] > 0].min()
        assert torch.equal(probs[row, differ], boundary.expand(differ.numel()))


def test_top_p_leaves_rows_without_a_nucleus_alone():
    probs = torch.rand(3, 2000, generator=torch.Generator().manual_seed(3)).softmax(dim=-1)
    got = sampler._apply_top_p(probs, torch.tensor([1.0, 0.3, 1.0]))
    assert torch.equal(got[[0, 2]], probs[[0, 2]])
    assert torch.equal(got[1], _sorted_top_p(probs[1:2], torch.tensor([0.3]))[0])


def test_top_p_with_ties_keeps_the_same_mass():
    probs = torch.full((2, 4000), 1 / 4000)
    got = sampler._apply_top_p(probs, torch.tensor([0.5, 0.9]))
    want = _sorted_top_p(probs, torch.tensor([0.5, 0.9]))
    assert torch.equal((got > 0).sum(dim=-1), (want > 0).sum(dim=-1))


@settings(max_examples=60, deadline=None)
@given(vocab=st.sampled_from([5, 300, 49152]), ks=st.lists(st.integers(0, 60000), min_size=1, max_size=4),
       seed=st.integers(0, 2**16))
def test_top_k_equals_the_full_sort(vocab, ks, seed):
    logits = torch.randn(len(ks), vocab, generator=torch.Generator().manual_seed(seed))
    logits[:, :3] = logits[:, 3:4]  # ties at one value
    assert torch.equal(sampler._apply_top_k(logits, ks), _sorted_top_k(logits, ks))


def test_draw_follows_the_distribution_and_skips_zeros():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.25, 0.125, 0.125, 0.0]) * 8  # unnormalised on purpose
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([sampler.draw(probs, gen) for _ in range(20_000)]), minlength=7).double()
    assert counts[[0, 2, 6]].sum() == 0
    expected = probs.double() / probs.sum() * 20_000
    chi2 = ((counts[[1, 3, 4, 5]] - expected[[1, 3, 4, 5]]) ** 2 / expected[[1, 3, 4, 5]]).sum()
    assert chi2 < 16.3  # 3 degrees of freedom: p = 0.001


def test_draw_depends_only_on_its_generator():
    probs = torch.rand(49152, generator=torch.Generator().manual_seed(1))
    first = [sampler.draw(probs, torch.Generator().manual_seed(s)) for s in range(20)]
    noise = torch.Generator().manual_seed(99)
    again = []
    for s in range(20):
        sampler.draw(probs, noise)  # another request's draw in between
        again.append(sampler.draw(probs, torch.Generator().manual_seed(s)))
    assert first == again and len(set(first)) > 10


def test_draw_of_a_single_token():
    one_hot = torch.zeros(100)
    one_hot[42] = 3.0
    assert {sampler.draw(one_hot, torch.Generator().manual_seed(s)) for s in range(50)} == {42}


class _Greedy:
    """What `sample` reads of a greedy request with no processors and no log-probs."""

    params = SamplingParams(temperature=0.0)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 24), vocab=st.sampled_from([5, 300, 49152]), levels=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_greedy_picks_the_first_maximal_token(rows, vocab, levels, seed):
    """Greedy rows take max's index (faster than argmax on CPU): the first maximal token, ties included."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (rows, vocab), generator=gen).float()  # few values: many ties
    greedy = sampler.sample(logits, [_Greedy() for _ in range(rows)])[0]
    first = [int(torch.nonzero(row == row.max())[0]) for row in logits]
    assert greedy == first


def test_greedy_tokens_pick_as_torch_argmax():
    """numpy's argmax (the greedy rows' pick) against torch's on random rows, ties, NaN and infinities, and a
    non-contiguous view: the first maximal index, a NaN counting as the maximum."""
    from kvserve.engine.sampler import greedy_tokens

    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(64, 1000, generator=gen).round(decimals=1)  # many ties
    nan, inf = float("nan"), float("inf")
    rows[1, [5, 700]] = nan
    rows[2, [3, 9]] = inf
    rows[3] = -inf
    rows[4, 10] = nan
    rows[4, 2] = inf
    for logits in (rows, rows[:, ::2], rows[:1]):
        assert greedy_tokens(logits).tolist() == torch.argmax(logits, dim=-1).tolist()
    assert greedy_tokens(rows)[:5].tolist() == [int(rows[0].argmax()), 5, 3, 0, 10]

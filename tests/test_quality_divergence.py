"""``coarse_kl`` and ``top_margin`` (semkv.research.quality) against full distributions."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")

from semkv.research.quality import coarse_kl, top_margin  # noqa: E402


def _log_softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    z = m + math.log(sum(math.exp(x - m) for x in xs))
    return [x - z for x in xs]


def _topk(lp: list[float], k: int) -> dict[int, float]:
    return dict(sorted(enumerate(lp), key=lambda t: -t[1])[:k])


logits = st.lists(st.floats(-8, 8), min_size=6, max_size=40)


@settings(max_examples=200, deadline=None)
@given(a=logits, noise=st.lists(st.floats(-2, 2), min_size=40, max_size=40),
       k=st.integers(1, 10))
def test_coarse_kl_is_a_lower_bound_that_is_exact_on_full_lists(a, noise, k) -> None:
    p = _log_softmax(a)
    q = _log_softmax([x + n for x, n in zip(a, noise, strict=False)])
    full = sum(math.exp(pi) * (pi - qi) for pi, qi in zip(p, q, strict=True))
    assert coarse_kl(dict(enumerate(p)), dict(enumerate(q))) == pytest.approx(full, abs=1e-9)
    coarse = coarse_kl(_topk(p, k), _topk(q, k))
    assert -1e-12 <= coarse <= full + 1e-9
    assert coarse_kl(_topk(p, k), _topk(p, k)) == pytest.approx(0.0, abs=1e-12)


def test_a_changed_top_token_is_seen() -> None:
    p = _log_softmax([3.0, 1.0, 0.0, 0.0])
    q = _log_softmax([1.0, 3.0, 0.0, 0.0])
    assert coarse_kl(_topk(p, 2), _topk(q, 2)) > 0.5


def test_top_margin() -> None:
    assert top_margin({1: -0.1, 2: -2.5, 3: -4.0}) == pytest.approx(2.4)
    assert top_margin({7: -0.0}) == math.inf

"""The cost model of realized spans: predicted TTFT against a cold prefill, from measured rates.

A realized request's first token comes after (1) the worker's realization of its span (read and
place the local prefix and the donors' blocks, compute the gaps and the copied tokens the
recompute strategy selects, write the span's blocks) and (2) vLLM's own prefill of the tail
after the span. Without it, the same request prefills everything after its local prefix, in
steps of at most ``max_num_batched_tokens``. Both are predicted from rates the engine itself
showed, never from constants of one machine:

- **vLLM's forward**, per engine step: ``t = a + b·tokens + c·attention``, where ``attention``
  is, summed over the step's requests, ``n·ctx + n(n+1)/2`` for ``n`` tokens computed after
  ``ctx`` cached ones (the query-key pairs causal attention computes). ``StepWork``.
- **the worker's realization**, per span: ``t = a + b·moved + c·computed + d·attention``:
  ``moved`` the rows read, placed and written per layer (local prefix, donor blocks, the span's
  positions), ``computed`` the tokens computed, in full-depth equivalents (blend's probe layers
  over every span position count ``probe/layers`` of a token each), ``attention`` the
  query-key pairs of its layer calls, also per layer (each call attends its chunk of positions
  over every position up to its last one: ``n·context``; a call over ``0..n-1`` is causal:
  ``n(n+1)/2``). ``RealizeWork``.

``RateFit`` keeps each as weighted least squares with non-negative coefficients: every subset
of the features is solved from the running sums, and of the feasible fits (no negative rate)
the one of least BIC wins (``n·ln(SSE/n) + k·ln(n)``, ``n`` the effective samples, SSE no
lower than the timings' own noise, ``NOISE``): a feature stays out until the samples tell it
apart, so that a few samples of two shapes under a noisy load do not buy a fixed cost per step
that no step has. A sample is weighted by ``1/size²``, ``size`` its scaled work (every feature
but the constant over its scale, plus ``SIZE_FLOOR``): about relative errors, a 30-token step
and a 1K-token chunk count alike, from the work alone, so a machine that turned slower is not
weighted down for it (weighting by the time itself would). Older samples decay, so the rates
follow the machine's load. A sample ``OUTLIER`` times off the fit (a stall: the process
descheduled, a one-off initialization) is left out, unless ``OUTLIER_RUN`` come in a row.
Every fit also measures its own error: each sample is first predicted by the fit as it stands
(once it has more samples than features), and the mean absolute relative miss (decayed like the
samples, starting from ``PRIOR_ERROR`` as one sample) is its ``error``. The gate decides on the
gain discounted by both fits' errors (``Prediction.gain = point_gain / (1 + margin)``): on a
steady engine whose fits predict within a few percent it is the point prediction; on a loaded,
noisy one (this 2-core machine shared with other work: the same prompt's cold TTFT 8.4 s and
12.0 s a minute apart) a plan must promise proportionally more to be served, so that a
prediction error does not serve a request slower than its cold run.
Everything here is a handful of floats per sample and per prediction: no numpy, no torch.

NOTE: the model is of an engine serving one request at a time. On a busy engine a realization
advances a bounded share per step and prefill chunks share steps with other requests; both
sides of the prediction slow down, not necessarily alike.
NOTE: without a prefill sample yet (an engine whose first requests realize donors of another
replica), vLLM's prefill is priced as the worker's own computation of the same tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# Feature scales: each scaled feature is about 1 on a 1K-token request, so the normal
# equations stay well conditioned in plain floats.
PREFILL_SCALES = (1.0, 1e3, 1e6)
REALIZE_SCALES = (1.0, 1e3, 1e3, 1e6)
# Among fits as good, fewer features win, then these first: a rate per token before a fixed cost
# (one 1K-token sample must not price a 10-token tail like a 1K-token chunk).
PREFILL_PREFER = (1, 2, 0)
REALIZE_PREFER = (2, 1, 3, 0)
PREFILL_DECAY = 0.99  # per step sample: the last few hundred steps count
REALIZE_DECAY = 0.9  # per realization: the last few dozen realizations count
SIZE_FLOOR = 0.05  # the scaled work of a step that computes almost nothing (weights only)
PRIOR_ERROR = 0.25  # a fit's error before it has measured any (counts as one sample)
MAX_MARGIN = 1.0  # the gain is never discounted by more than half
NOISE = 0.02  # relative error of a timing: fits closer than this are not told apart
OUTLIER = 10.0  # a sample this many times off the current fit is a stall, not a rate...
OUTLIER_RUN = 3  # ...unless this many in a row are: the machine changed, the fit follows
OUTLIER_AFTER = 8  # samples before any is judged an outlier
_SINGULAR = 1e-10  # relative pivot under which a subset of features is not identifiable


def chunk_attention(context: int, n: int) -> int:
    """Query-key pairs of ``n`` tokens computed causally after ``context`` cached ones."""
    return n * context + n * (n + 1) // 2


@dataclass(frozen=True)
class StepWork:
    """One engine step's forward: tokens computed, and their attention pairs."""

    tokens: int
    attention: int

    def features(self) -> tuple[float, ...]:
        return (1.0, float(self.tokens), float(self.attention))


def prefill_steps(start: int, end: int, chunk_tokens: int) -> list[StepWork]:
    """The steps of a lone request prefilling ``[start, end)`` in chunks of ``chunk_tokens``."""
    steps = []
    for lo in range(start, end, max(1, chunk_tokens)):
        n = min(chunk_tokens, end - lo)
        steps.append(StepWork(n, chunk_attention(lo, n)))
    return steps


@dataclass(frozen=True)
class RealizeWork:
    """One realization: rows moved per layer, tokens computed and their attention pairs
    (both in full-depth equivalents)."""

    moved: int
    computed: float
    attention: float

    def features(self) -> tuple[float, ...]:
        return (1.0, float(self.moved), self.computed, self.attention)


def call_attention(positions: Sequence[int], chunk_tokens: int | None) -> int:
    """Query-key pairs of one layer's calls over increasing ``positions`` (at most
    ``chunk_tokens`` per call): ``n·context`` per call, ``n(n+1)/2`` for a call over 0..n-1."""
    n = len(positions)
    step = n if chunk_tokens is None else max(1, min(chunk_tokens, n))
    total = 0
    for lo in range(0, n, max(1, step)):
        part = positions[lo: lo + step]
        last = part[-1] + 1
        total += len(part) * (len(part) + 1) // 2 if last == len(part) else len(part) * last
    return total


def realize_work(layers: int, moved: int, passes: Sequence[tuple[int, Sequence[int]]],
                 chunk_tokens: int | None) -> RealizeWork:
    """``passes``: (layers, increasing positions computed in each of them)."""
    depth = max(1, layers)
    computed = sum(n * len(at) for n, at in passes) / depth
    attention = sum(n * call_attention(at, chunk_tokens) for n, at in passes if at) / depth
    return RealizeWork(moved, computed, attention)


class RateFit:
    """Seconds as a non-negative linear function of features, fitted by weighted least squares
    from running sums (module docstring)."""

    def __init__(self, scales: Sequence[float], decay: float = 1.0,
                 prefer: Sequence[int] | None = None) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError("decay must lie in (0, 1]")
        self.scales = tuple(float(s) for s in scales)
        self.decay = decay
        k = len(self.scales)
        self.prefer = tuple(range(k) if prefer is None else prefer)
        if sorted(self.prefer) != list(range(k)):
            raise ValueError("prefer must order every feature once")
        self._xx = [[0.0] * k for _ in range(k)]
        self._xy = [0.0] * k
        self._yy = 0.0
        self.samples = 0
        self._n = 0.0  # effective samples (decayed)
        self.outliers = 0  # samples left out (module docstring)
        self._run = 0  # outliers in a row
        self._miss, self._misses = PRIOR_ERROR, 1.0  # decayed sums of |t/t̂ - 1| and weights
        self._coef: tuple[float, ...] | None = None
        self._dirty = False

    def add(self, features: Sequence[float], seconds: float) -> bool:
        """One measurement; False (ignored) when it is not a positive finite time."""
        if not (math.isfinite(seconds) and seconds > 0.0) or len(features) != len(self.scales):
            return False
        x = [float(f) / s for f, s in zip(features, self.scales, strict=True)]
        if not all(math.isfinite(v) and v >= 0.0 for v in x):
            return False
        expected = self.predict(features) if self.samples >= OUTLIER_AFTER else None
        if expected and not 1.0 / OUTLIER <= seconds / expected <= OUTLIER:
            self._run += 1
            if self._run < OUTLIER_RUN:
                self.outliers += 1
                return False
        self._run = 0
        if self.samples > len(self.scales):  # an out-of-sample prediction: the fit's own error
            before = expected if expected is not None else self.predict(features)
            if before is not None and before > 0.0:
                self._miss = self.decay * self._miss + abs(seconds / before - 1.0)
                self._misses = self.decay * self._misses + 1.0
        size = sum(x[1:]) + SIZE_FLOOR  # features()[0] is the constant
        w, d = 1.0 / (size * size), self.decay
        for i, xi in enumerate(x):
            self._xy[i] = d * self._xy[i] + w * xi * seconds
            row = self._xx[i]
            for j, xj in enumerate(x):
                row[j] = d * row[j] + w * xi * xj
        self._yy = d * self._yy + w * seconds * seconds
        self._n = d * self._n + 1.0
        self.samples += 1
        self._dirty = True
        return True

    @property
    def error(self) -> float:
        """Mean absolute relative error of its predictions of new samples (module docstring)."""
        return self._miss / self._misses

    def coefficients(self) -> tuple[float, ...] | None:
        """Seconds per unit of each (unscaled) feature; None before any sample."""
        if self.samples == 0:
            return None
        if self._dirty:
            self._coef, self._dirty = self._solve(), False
        return self._coef

    def predict(self, features: Sequence[float]) -> float | None:
        coef = self.coefficients()
        if coef is None:
            return None
        return sum(c * float(f) for c, f in zip(coef, features, strict=True))

    def _solve(self) -> tuple[float, ...] | None:
        k, n = len(self.scales), max(self._n, 1.0)
        best: tuple[float, list[int], list[float]] | None = None
        # Fewer features first, then the preferred ones: a later subset must score strictly
        # better.
        subsets = sorted(([i for i in self.prefer if m >> i & 1] for m in range(1, 1 << k)),
                         key=lambda idx: (len(idx), [self.prefer.index(i) for i in idx]))
        for idx in subsets:
            beta = _gauss([[self._xx[i][j] for j in idx] for i in idx],
                          [self._xy[i] for i in idx])
            if beta is None or any(b < 0.0 for b in beta):
                continue
            sse = self._yy - 2.0 * sum(b * self._xy[i] for b, i in zip(beta, idx, strict=True))
            sse += sum(beta[a] * beta[b] * self._xx[i][j]
                       for a, i in enumerate(idx) for b, j in enumerate(idx))
            floor = n * NOISE * NOISE  # no fit is better than the timings themselves
            bic = n * math.log(max(sse, floor) / n) + len(idx) * math.log(max(n, 2.0))
            if best is None or bic < best[0] - 1e-9:
                best = (bic, idx, beta)
        if best is None:
            return None
        coef = [0.0] * k
        for i, b in zip(best[1], best[2], strict=True):
            coef[i] = b / self.scales[i]
        return tuple(coef)


def _gauss(a: list[list[float]], b: list[float]) -> list[float] | None:
    """``a x = b`` by elimination with partial pivoting; None when ``a`` is (near) singular."""
    n = len(b)
    scale = max((abs(a[i][i]) for i in range(n)), default=0.0)
    if scale <= 0.0:
        return None
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= _SINGULAR * scale:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


@dataclass(frozen=True)
class Prediction:
    """Predicted seconds to the first token, cold and realized (realization + tail), and the
    relative margin the fits' own errors call for."""

    cold_s: float
    realize_s: float
    tail_s: float
    margin: float = 0.0

    @property
    def realized_s(self) -> float:
        return self.realize_s + self.tail_s

    @property
    def point_gain(self) -> float:
        return self.cold_s / self.realized_s if self.realized_s > 0.0 else math.inf

    @property
    def gain(self) -> float:
        """What the gate decides on: the point gain discounted by the margin."""
        return self.point_gain / (1.0 + self.margin)


class EngineRates:
    """The engine's measured rates and the predictions made from them (module docstring)."""

    def __init__(self, chunk_tokens: int, *, prefill_decay: float = PREFILL_DECAY,
                 realize_decay: float = REALIZE_DECAY) -> None:
        self.chunk_tokens = max(1, int(chunk_tokens))  # vLLM's max_num_batched_tokens
        self.prefill = RateFit(PREFILL_SCALES, prefill_decay, PREFILL_PREFER)
        self.realize = RateFit(REALIZE_SCALES, realize_decay, REALIZE_PREFER)

    def add_step(self, work: StepWork, seconds: float) -> bool:
        return self.prefill.add(work.features(), seconds)

    def add_realization(self, work: RealizeWork, seconds: float) -> bool:
        return self.realize.add(work.features(), seconds)

    def prefill_seconds(self, start: int, end: int) -> float | None:
        """vLLM's prefill of ``[start, end)``, alone, in chunks (0.0 when empty)."""
        total = 0.0
        for step in prefill_steps(start, end, self.chunk_tokens):
            t = (self.prefill.predict(step.features()) if self.prefill.samples
                 else self.realize.predict(RealizeWork(step.tokens, float(step.tokens),
                                                       float(step.attention)).features()))
            if t is None:
                return None
            total += t
        return total

    def realize_seconds(self, work: RealizeWork) -> float | None:
        return self.realize.predict(work.features())

    def predict(self, local: int, span: int, prompt: int, work: RealizeWork, *,
                fallback_from: int | None = None) -> Prediction | None:
        """A request of ``prompt`` tokens, ``local`` of them in vLLM's prefix cache, realized up
        to ``span``, against its fallback: vLLM prefilling everything after ``local``, or after
        ``fallback_from`` where an exact prefix up to there would be served instead (its load
        is not priced: a block copy, far cheaper than the prefill it saves)."""
        cold = self.prefill_seconds(local if fallback_from is None else fallback_from, prompt)
        tail = self.prefill_seconds(span, prompt)
        realize = self.realize_seconds(work)
        if cold is None or tail is None or realize is None:
            return None
        margin = min(MAX_MARGIN, self.realize.error + (
            self.prefill.error if self.prefill.samples else self.realize.error))
        return Prediction(cold, realize, tail, margin)

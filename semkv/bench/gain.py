"""The cost gate read against what happened: predicted TTFT gain vs measured, per request.

Every served realized span carries the gain the cost gate predicted for its plan
(``kv_transfer_params["semkv"]["span"]["predicted_gain"]``, ``semkv_vllm.cost_gate``); the
bench measures the same request's gain as its cold run's TTFT over its own (the same prompt on
the same engine). The error of one prediction is relative, ``predicted / measured - 1``:
positive when the gate promised more than it got (the direction that can serve a request slower
than cold), negative when it was conservative.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def gain_errors(pairs: Iterable[tuple[float | None, float | None]]) -> dict[str, Any]:
    """(predicted, measured) gains -> counts, medians and the error's median and p90.

    Pairs missing either side (a request not priced, or not timed) are left out; ``slower``
    counts served requests whose measured gain was under 1 (slower than their cold run).
    """
    both = [(p, m) for p, m in pairs if p is not None and m is not None and m > 0]
    errors = [p / m - 1.0 for p, m in both]
    absolute = [abs(e) for e in errors]
    return {
        "priced": len(both),
        "predicted_median": statistics.median([p for p, _ in both]) if both else None,
        "measured_median": statistics.median([m for _, m in both]) if both else None,
        "error_median": statistics.median(errors) if errors else None,
        "abs_error_median": statistics.median(absolute) if absolute else None,
        "abs_error_p90": percentile(absolute, 90),
        "slower": sum(m < 1.0 for _, m in both),
    }

"""semkv's connector stats for vLLM (``KVConnectorStats``) and their Prometheus series.

Scheduler-side stats (lookups, decisions, fallbacks) and worker-side stats (blocks actually
copied) both travel as ``SemkvConnectorStats``; vLLM aggregates them and hands the data to
``SemkvPromMetrics.observe`` in the API server, which exports ``vllm:semkv_*`` series.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from semkv.metrics import FAMILIES, GAUGES, HISTOGRAMS, CounterBag, split


@dataclass
class SemkvConnectorStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = CounterBag().to_dict()

    def bag(self) -> CounterBag:
        return CounterBag.from_dict(self.data)

    def is_empty(self) -> bool:
        return self.bag().is_empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            self.data = self.bag().merge([CounterBag.from_dict(other.data)]).to_dict()
        return self

    def reduce(self) -> dict[str, int | float]:
        bag = self.bag()
        out: dict[str, int | float] = dict(bag.counters)
        out.update(bag.gauges)
        for name, values in bag.observations.items():
            if values:
                ordered = sorted(values)
                if name.endswith("_seconds"):
                    out[f"{name}_p50_ms"] = round(ordered[len(ordered) // 2] * 1e3, 3)
                    out[f"{name}_max_ms"] = round(ordered[-1] * 1e3, 3)
                else:
                    out[f"{name}_p50"] = ordered[len(ordered) // 2]
                    out[f"{name}_max"] = ordered[-1]
        return out


class SemkvPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, Any] = {}
        for family, (label, doc) in FAMILIES.items():
            names = labelnames + ([label] if label else [])
            self._counters[family] = self._counter_cls(
                name=f"vllm:semkv_{family}_total", documentation=doc, labelnames=names)
        self._gauges = {
            name: self._gauge_cls(name=f"vllm:semkv_{name}", documentation=doc,
                                  labelnames=labelnames, multiprocess_mode="mostrecent")
            for name, doc in GAUGES.items()
        }
        self._histograms = {
            name: self._histogram_cls(name=f"vllm:semkv_{name}", documentation=doc,
                                      labelnames=labelnames, buckets=list(buckets))
            for name, (doc, buckets) in HISTOGRAMS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any] | None, engine_idx: int = 0) -> None:
        if not transfer_stats_data:
            return
        engine = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        bag = CounterBag.from_dict(transfer_stats_data)
        for counter_key, count in bag.counters.items():
            family, label = split(counter_key)
            metric = self._counters.get(family)
            if metric is not None and count:
                metric.labels(*engine, *([label] if label else [])).inc(count)
        for name, level in bag.gauges.items():
            if name in self._gauges:
                self._gauges[name].labels(*engine).set(level)
        for name, values in bag.observations.items():
            if name in self._histograms:
                for value in values:
                    self._histograms[name].labels(*engine).observe(value)

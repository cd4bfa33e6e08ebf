#!/bin/bash
# gpu_check.py on a GPU machine whose python3 has CUDA torch and Triton but none of kserve's other
# dependencies and no network: install the wheels carried in .whl/ (docs/gpu_check.md lists them) into
# $SITE, copy the package as it installs (kernels/ and configs/ inside kserve/), check the imports, run.
#   OUT=DIR bash benchmarks/gpu_check_bare.sh [gpu_check.py arguments]
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO" || exit 2
SITE=${SITE:-/tmp/kserve_site}
PKG=${PKG:-/tmp/kserve_pkg}
OUT=${OUT:-$REPO/gpu_check_out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 3
fi
rm -rf "$PKG" && mkdir -p "$PKG" && cp -r kserve "$PKG/" && cp -r kernels "$PKG/kserve/kernels" \
  && cp -r configs "$PKG/kserve/configs" || exit 4
export PYTHONPATH="$PKG:$SITE" PYTHONUNBUFFERED=1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
cd /tmp || exit 2  # not the repository root, whose kernels/ would shadow Hugging Face's kernels package
python3 -c "import torch, triton, xgrammar, fastapi, uvicorn, openai, httpx, jsonschema, kserve.kernels.fused_moe, kserve.server" || exit 5
timeout "${LIMIT_S:-560}" python3 "$REPO/benchmarks/gpu_check.py" --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"

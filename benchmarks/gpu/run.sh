#!/usr/bin/env bash
# The one-call GPU check of pipetrain (see docs/gpu.md):
#
#   bash benchmarks/gpu/run.sh OUT_DIR [--device cpu|cuda] [--quick] [--items a,b]
#
# Writes one JSON file per item and OUT_DIR/summary.json. Finds torchgpipe 0.0.7 in
# benchmarks/gpu/.deps (made here by benchmarks/gpu/prepare.sh; carry it to the GPU
# machine). Python: $PYTHON if set, else the repository's .venv if there is one, else
# python3.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
if [[ $# -lt 1 || "$1" == -* ]]; then
    echo "usage: bash benchmarks/gpu/run.sh OUT_DIR [--device cpu|cuda] [--quick] [--items a,b]" >&2
    exit 2
fi
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
    if [[ -x "$root/.venv/bin/python" ]]; then python="$root/.venv/bin/python"; else python=python3; fi
fi
if [[ ! -d "$here/.deps/torchgpipe" ]]; then
    echo "note: benchmarks/gpu/.deps/torchgpipe is missing (run benchmarks/gpu/prepare.sh where" \
         "torchgpipe is installed, and carry the folder); torchgpipe is looked for on the path" >&2
fi
export PYTHONPATH="$root/src:$root/benchmarks:$here/.deps${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
cd "$root"
exec "$python" "$here/check.py" "$@"

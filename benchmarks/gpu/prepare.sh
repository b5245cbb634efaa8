#!/usr/bin/env bash
# Copies torchgpipe 0.0.7 (pure Python) from this machine's Python into
# benchmarks/gpu/.deps/torchgpipe (an ignored folder), for the GPU machine, which has
# no package index: carry benchmarks/gpu/.deps with the working tree there.
#
#   bash benchmarks/gpu/prepare.sh          # Python: $PYTHON, else .venv, else python3
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
    if [[ -x "$root/.venv/bin/python" ]]; then python="$root/.venv/bin/python"; else python=python3; fi
fi
source_dir="$("$python" -c 'import os, torchgpipe; print(os.path.dirname(torchgpipe.__file__))' 2>/dev/null)" || {
    echo "torchgpipe is not installed for $python; fix: $python -m pip install torchgpipe==0.0.7" >&2
    exit 2
}
version="$("$python" -c 'import torchgpipe; print(torchgpipe.__version__)')"
if [[ "$version" != "0.0.7" ]]; then
    echo "torchgpipe $version found at $source_dir; the check compares against 0.0.7" \
         "(fix: $python -m pip install torchgpipe==0.0.7)" >&2
    exit 2
fi
rm -rf "$here/.deps/torchgpipe"
mkdir -p "$here/.deps"
cp -r "$source_dir" "$here/.deps/torchgpipe"
find "$here/.deps" -name __pycache__ -type d -prune -exec rm -rf {} +
echo "copied torchgpipe $version to benchmarks/gpu/.deps/torchgpipe ($(du -sh "$here/.deps" | cut -f1));" \
     "carry benchmarks/gpu/.deps to the GPU machine"

#!/usr/bin/env bash
# Idempotent set-up of a chestnut checkout: system packages, a virtual environment in .venv and
# the package with its dev extras. Safe to run again; does only what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v clang >/dev/null || need_apt+=(clang)          # tinygrad's CPU device compiles with clang
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing system packages: ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.chestnut-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing chestnut and its Python dependencies into .venv"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[dev,cluster]"  # cluster: Ray, for replay/check --executor ray
  # The pretrained PP-OCRv4 detector ships inside this wheel; its own dependencies (OpenCV,
  # Shapely, ...) are not needed to read the model file, so it is installed without them.
  .venv/bin/python -m pip install -q --no-deps "rapidocr-onnxruntime==1.4.4"
  touch "$stamp"
fi

# The pretrained model, prepared for the node (shape fixed, repaired, checked, compile cache filled).
.venv/bin/chestnut model prepare

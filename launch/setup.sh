#!/usr/bin/env bash
# Idempotent set-up of a chestnut checkout: system packages, a virtual environment in .venv and
# the package with its dev extras. Safe to run again; does only what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v clang >/dev/null || need_apt+=(clang)          # tinygrad's CPU device compiles with clang
# The twin's libusb face (backend/sim/libusb_face.py, tests/test_libusb_twin.py): umockdev emulates the dock's
# usbdevfs node for real libusb-1.0, driven from Python through PyGObject (Debian bookworm: umockdev 0.17.16)
if command -v dpkg-query >/dev/null; then
  for pkg in umockdev libumockdev0 gir1.2-umockdev-1.0 python3-gi libusb-1.0-0; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need_apt+=("$pkg")
  done
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  as_root=()
  [ "$(id -u)" -eq 0 ] || as_root=(sudo -n)
  if [ ${#as_root[@]} -gt 0 ] && ! sudo -n true 2>/dev/null; then
    echo "setup: not root and no password-less sudo: install these system packages yourself: ${need_apt[*]}" >&2
  else
    echo "setup: installing system packages: ${need_apt[*]}"
    export DEBIAN_FRONTEND=noninteractive
    "${as_root[@]}" apt-get update -qq
    "${as_root[@]}" apt-get install -y -qq "${need_apt[@]}" >/dev/null
  fi
fi

# pip's own output is quiet (-q); setuptools' editable-install notice (a block of asterisks about folders
# named like the package, expected here: the package maps its folders itself) is filtered from stderr
quiet_pip() {
  local err rc=0
  err=$(mktemp)
  "$@" 2>"$err" || rc=$?
  awk '/BuildBackendWarning: Editable installation/ {skip = 1}
       !skip {print}
       skip && /WheelFile\(wheel_path/ {skip = 0}' "$err" >&2
  rm -f "$err"
  return $rc
}

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.chestnut-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing chestnut and its Python dependencies into .venv"
  quiet_pip .venv/bin/python -m pip install -q --upgrade pip
  quiet_pip .venv/bin/python -m pip install -q -e ".[dev,cluster]"  # cluster: Ray, for replay/check --executor ray
  # The pretrained PP-OCRv4 detector ships inside this wheel; its own dependencies (OpenCV,
  # Shapely, ...) are not needed to read the model file, so it is installed without them.
  quiet_pip .venv/bin/python -m pip install -q --no-deps "rapidocr-onnxruntime==1.4.4"
  # matplotlib builds its font cache on first import and says so; build it here, once, silently
  .venv/bin/python -c "import matplotlib.font_manager" >/dev/null 2>&1 || true
  touch "$stamp"
fi

# The pretrained model, prepared for the node (shape fixed, repaired, checked, compile cache filled).
.venv/bin/chestnut model prepare

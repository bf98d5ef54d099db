#!/usr/bin/env bash
# Set up if needed, then run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
exec .venv/bin/python -m pytest "$@"

#!/usr/bin/env bash
# Set up if needed, lint the package (ruff check, then mypy; the first finding stops the run), then run the
# tests of one tier (the first argument; the rest go to pytest):
#   (none)  the quick tier: every test not marked `slow` (pure rules, one program or one twin at a time), two
#           workers -- a few minutes
#   --slow  the slow tier: the tests marked `slow` (a node process, a launched stack, tinygrad against the twin,
#           a Ray cluster, acceptance), one worker
#   --all   the quick tier, then the slow tier (what CI runs); fails if either fails
set -euo pipefail
cd "$(dirname "$0")/.."
tier=quick
case "${1:-}" in
  --all) tier=all; shift ;;
  --slow) tier=slow; shift ;;
  --quick) shift ;;
esac
bash launch/setup.sh

echo "ruff check (settings: pyproject.toml [tool.ruff])"
.venv/bin/ruff check --output-format concise msgs backend fallback node launch tests

# mypy must see the package as `chestnut.*` to follow imports between its modules, but the source folders are
# mapped to it by setuptools' package-dir (pyproject.toml), which only the editable install's import hook
# knows. A tree of links named like the package (under the ignored .mypy_cache/, rebuilt on every run) gives
# mypy the same view, with a cache of its own; its file names are printed back as the repository's paths.
root=.mypy_cache/package/root
rm -rf "$root" && mkdir -p -m 0700 "$root/chestnut"
packages=()
while read -r pkg dir; do
  ln -s "$PWD/$dir" "$root/$(tr . / <<<"$pkg")"
  packages+=(-p "$pkg")
done < <(.venv/bin/python - <<'EOF'
import tomllib

dirs = tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]["package-dir"]
for pkg, folder in dirs.items():
    if pkg.count(".") == 1:  # chestnut.X; deeper packages lie inside their parent's folder
        print(pkg, folder)
EOF
)
echo "mypy (settings: pyproject.toml [tool.mypy]) on ${packages[*]}"
MYPYPATH="$root" .venv/bin/mypy --cache-dir .mypy_cache/package/cache "${packages[@]}" | sed "s#^$root/chestnut/##"

# The tests run in pytest-xdist workers, a test file at a time (`--dist loadfile`: a module's fixtures -- a
# compiled model, a launched stack -- are made once). The quick tier runs in two workers
# (CHESTNUT_TEST_WORKERS), the slow tier in one (CHESTNUT_SLOW_WORKERS): each node and launched stack runs at
# realtime priorities, and two of them on this 2-core machine starve each other's twin -- the timing tests of
# both fail now and then (one of 183 slow tests in a two-worker run of that tier). 0 runs a tier in this process. The slowest tests of
# each tier are listed at its end.
run_tier() {  # marker expression, workers, extra pytest arguments
  local expr=$1 workers=$2
  shift 2
  echo "pytest: tests ${expr}, ${workers} worker(s)"
  .venv/bin/python -m pytest -n "$workers" --dist loadfile --durations=15 -m "$expr" "$@"
}
quick() { run_tier "not slow" "${CHESTNUT_TEST_WORKERS:-2}" "$@"; }
slow() { run_tier "slow" "${CHESTNUT_SLOW_WORKERS:-1}" "$@"; }
case "$tier" in
  quick) quick "$@" ;;
  slow) slow "$@" ;;
  all)
    rc=0
    quick "$@" || rc=$?
    slow "$@" || { r=$?; [ "$rc" -ne 0 ] || rc=$r; }
    exit "$rc" ;;
esac

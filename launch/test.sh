#!/usr/bin/env bash
# Set up if needed, lint the package (ruff check, then mypy; the first finding stops the run), then run the
# test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
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

# The tests run in a pytest-xdist worker, a test file at a time (`--dist loadfile`: a module's fixtures -- a
# compiled model, a launched stack -- are made once). One worker by default: each launched stack runs at
# realtime priorities, and two workers on this 2-core machine put two stacks on two cores, where the twins'
# CPU-bound GPUs fall behind and the timing tests of both fail now and then (4 of 1625 in one run).
# CHESTNUT_TEST_WORKERS=2 runs two at once (about half the time), 0 runs them in this process.
# The slowest tests are listed at the end.
exec .venv/bin/python -m pytest -n "${CHESTNUT_TEST_WORKERS:-1}" --dist loadfile --durations=15 "$@"

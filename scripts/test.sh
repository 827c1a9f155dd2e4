#!/usr/bin/env bash
# The test command: installs everything the tests need, then lint, types and the test suite.
# Run as root on a fresh Debian bookworm machine (CI runs it through .ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
top=$(pwd)
scripts/install-deps.sh --test
echo "== ruff"
python3 -m ruff check .
echo "== mypy"
(cd / && python3 -m mypy --config-file "$top/pyproject.toml" -p forkd)
echo "== pytest"
python3 -P -m pytest -q -ra --durations=15 "$@"

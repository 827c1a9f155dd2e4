#!/usr/bin/env bash
# The main job on the embedded default: installs forkd and its host prerequisites, then
# `forkd quickstart`: a local hub, a warm python-numpy snapshot built (or pulled), pushed,
# pulled into a fresh store, and 10 copy-on-write VM forks evaluating numpy; then the
# bundled packs (deeplethe/python-numpy, deeplethe/langgraph-react, deeplethe/coding-agent,
# deeplethe/code-interpreter) built and published, public, on that hub, which becomes the
# default hub. A second run
# reuses everything: nothing is rebuilt or pushed. Run as root on a fresh Debian bookworm
# machine.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
exec forkd quickstart --yes "$@"

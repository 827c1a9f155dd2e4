#!/usr/bin/env bash
# The main job on the embedded default: installs forkd and its host prerequisites, then
# `forkd quickstart`: a local hub, a warm python-numpy snapshot built (or pulled), pushed,
# pulled into a fresh store, and 10 copy-on-write VM forks evaluating numpy. A second run
# reuses everything. Run as root on a fresh Debian bookworm machine.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
exec forkd quickstart --yes "$@"

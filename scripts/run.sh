#!/usr/bin/env bash
# The main job on the embedded default: installs forkd, then runs it end to end with a local
# store (FORKD_HOME, default ~/.local/share/forkd). Run as root on a fresh Debian machine.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
exec forkd demo "$@"

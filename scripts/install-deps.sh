#!/usr/bin/env bash
# Installs what forkd needs on a fresh Debian bookworm machine (as root): forkd itself
# (editable, with pip), then the host prerequisites of the engine (`forkd setup --yes`:
# QEMU, qemu-img, debootstrap, busybox-static, cpio, e2fsprogs, lz4).
#   scripts/install-deps.sh          run time only
#   scripts/install-deps.sh --test   also the test tools (pip extra "test") and the Debian
#                                    packages in scripts/apt-packages-test.txt
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
# The engine's build uses `apt-get download`, which needs current package lists.
apt-get update -qq
extras=""
if [[ "${1:-}" == "--test" ]]; then
    extras="[test]"
    mapfile -t wanted < <(sed 's/#.*//' scripts/apt-packages-test.txt | xargs -r -n1 | sort -u)
    if ((${#wanted[@]})); then
        apt-get install -y -qq --no-install-recommends "${wanted[@]}" >/dev/null
    fi
fi
# strict editable mode: the hub/, engine/, cli/, controller/ folders install as forkd.hub,
# forkd.engine, … through a link tree, so imports and mypy see what a real install has.
python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore \
    -e ".${extras}" --config-settings editable_mode=strict
python3 -P -m forkd.cli setup --yes

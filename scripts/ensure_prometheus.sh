#!/usr/bin/env bash
# Make `prometheus` and `promtool` available to tests/deploy/test_prometheus.py, best effort:
#   1. both already on PATH: nothing to do;
#   2. apt-get usable (root, or password-less sudo): install Debian's prometheus package
#      (without recommends; in a container policy-rc.d keeps its service from starting, and
#      the tests never use the service or port 9090 anyway);
#   3. otherwise: say so and exit 0. The Prometheus tests then skip with this reason.
# Never fails: `make test` must run where nothing can be installed.
set -uo pipefail

have_prometheus() {
    command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1
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

if have_prometheus; then
    exit 0
fi
if run="$(apt_runner)"; then
    echo "ensure_prometheus: installing Debian's prometheus package with apt-get" >&2
    # $run is a command prefix and must split into words.
    # shellcheck disable=SC2086
    $run DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null ||
        echo "ensure_prometheus: apt-get update failed; trying the install anyway" >&2
    # shellcheck disable=SC2086
    $run DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus >/dev/null ||
        echo "ensure_prometheus: apt-get install prometheus failed" >&2
fi
if have_prometheus; then
    echo "ensure_prometheus: using $(prometheus --version 2>&1 | head -n 1)" >&2
else
    echo "ensure_prometheus: prometheus/promtool unavailable (no PATH entry, apt-get unusable or failed);" \
         "the Prometheus tests in tests/deploy will be skipped" >&2
fi
exit 0

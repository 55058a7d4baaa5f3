#!/usr/bin/env bash
# Make `prometheus` and `promtool` available to tests/deploy/test_prometheus.py, best effort:
#   1. both already on PATH: nothing to do;
#   2. apt-get usable (root, or password-less sudo): install Debian's prometheus package
#      (without recommends; in a container policy-rc.d keeps its service from starting, and
#      the tests never use the service or port 9090 anyway);
#   3. otherwise: say so and exit 0. The Prometheus tests then skip with this reason.
# Never fails: `make test` must run where nothing can be installed.
set -uo pipefail

# shellcheck source=scripts/apt_install.sh
. "$(dirname "$0")/apt_install.sh"

have_prometheus() {
    command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1
}

if have_prometheus; then
    exit 0
fi
apt_install ensure_prometheus prometheus --no-install-recommends >/dev/null
if have_prometheus; then
    echo "ensure_prometheus: using $(prometheus --version 2>&1 | head -n 1)" >&2
else
    echo "ensure_prometheus: prometheus/promtool unavailable (no PATH entry, apt-get unusable or failed);" \
         "the Prometheus tests in tests/deploy will be skipped" >&2
fi
exit 0

# Sourced by ensure_redis.sh and ensure_prometheus.sh: installing a Debian package, best effort.
#   apt_runner  prints the command prefix that runs apt-get as root (root, or password-less
#               sudo), or fails;
#   apt_install WHO PACKAGE [OPTION...]  apt-get update (a failing update, such as one
#               unreachable third-party list, need not stop the install), then apt-get install
#               -y -q PACKAGE OPTION...; fails when apt-get is unusable or the install failed.
#               WHO prefixes what it says on stderr.

apt_runner() {
    command -v apt-get >/dev/null 2>&1 || return 1
    if [ "$(id -u)" -eq 0 ]; then
        echo "env"
    elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        echo "sudo -n env"
    else
        return 1
    fi
}

apt_install() {
    local who="$1" run
    shift
    run="$(apt_runner)" || return 1
    echo "$who: installing $1 with apt-get" >&2
    # $run is a command prefix and must split into words.
    # shellcheck disable=SC2086
    $run DEBIAN_FRONTEND=noninteractive apt-get update -q ||
        echo "$who: apt-get update failed; trying the install anyway" >&2
    # shellcheck disable=SC2086
    $run DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" ||
        { echo "$who: apt-get install $1 failed" >&2; return 1; }
}

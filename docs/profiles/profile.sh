#!/bin/sh
# Usage: docs/profiles/profile.sh OP [SECONDS]  (from the repository root, the venv's python first on PATH)
# py-spy record --native on the daemon and on the client while drive.py runs OP; writes
# docs/profiles/OP-{daemon,client}.txt (top-N summaries) and keeps the raw stacks in /tmp.
set -e
op=$1; seconds=${2:-10}
ready=$(mktemp -u /tmp/st-prof-ready.XXXXXX)
python docs/profiles/drive.py "$op" "$seconds" "$ready" > "/tmp/st-prof-$op.count" &
driver=$!
while [ ! -s "$ready" ]; do sleep 0.2; done
read daemon client < "$ready"
load=$(cat /proc/loadavg)
py-spy record --native --format raw --rate 250 --duration $((seconds - 1)) -p "$daemon" -o "/tmp/st-prof-$op-daemon.raw" >/dev/null 2>&1 &
py-spy record --native --format raw --rate 250 --duration $((seconds - 1)) -p "$client" -o "/tmp/st-prof-$op-client.raw" >/dev/null 2>&1
wait $driver
sleep 1
for side in daemon client; do
  python docs/profiles/summarize.py "/tmp/st-prof-$op-$side.raw" "$(cat /tmp/st-prof-$op.count)" "load $load" \
    > "docs/profiles/$op-$side.txt"
done
rm -f "$ready"

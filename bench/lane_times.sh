#!/usr/bin/env bash
# The test lanes' wall times from a fresh clone of this repository's HEAD, as CI sees them:
#   bench/lane_times.sh [LANE...]        (default: test-fast test; e.g. test-full)
# Each lane runs in the same clone after setup; the stage lines (`stage NAME: N s (exit RC)`, printed
# by bench/timed) are collected into one table at the end. The clone is left in $WORK (default: a new
# temporary folder) with each lane's log, so a slow stage can be read.
set -uo pipefail
repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
work=${WORK:-$(mktemp -d /tmp/kvpool-lanes.XXXXXX)}
lanes=("$@")
[ ${#lanes[@]} -gt 0 ] || lanes=(test-fast test)
git clone --quiet "$repo" "$work/clone"
cd "$work/clone" || exit 1
echo "clone of $(git rev-parse --short HEAD) in $work/clone"
bench/timed setup make setup > "$work/setup.log" 2>&1
grep '^stage ' "$work/setup.log"
for lane in "${lanes[@]}"; do
  bench/timed "make $lane" make "$lane" > "$work/$lane.log" 2>&1
  grep '^stage ' "$work/$lane.log" | sed "s/^/[$lane] /"
done

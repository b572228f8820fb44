#!/bin/bash
# Run several configs on a lent GPU machine, detached, so no device call's time limit cuts a fleet:
#   bash bench/device_chain.sh start DEADLINE CAP CONFIG:TARGET [CONFIG:TARGET...]   (returns at once)
#   bash bench/device_chain.sh wait SECONDS      (a later call: the chain's log, then its packed results into $OUT)
# `start` copies the carried tree to /root/repo (a later call refreshes the carried copy under a running Snakemake)
# and runs bench/device_run.sh on each CONFIG:TARGET in turn, the first for at most CAP seconds, all of them ending
# by DEADLINE (epoch seconds; leave 90 s after it for the last one's packing and one call to fetch it). Each
# config's tarball goes to /root/keep: the device tool empties $OUT (/root/out) at every call. `wait` sleeps up to
# SECONDS while the chain runs, prints its log's tail and copies what /root/keep holds into this call's $OUT.
# Name the commit as for device_run.sh: KVPOOL_GIT_COMMIT=<git rev-parse HEAD> KVPOOL_GIT_DIRTY=<0 or 1>.
# Measured on the device tool's H100 (2026-12-06): a setsid process outlives the call that started it.
# Triton's cache (compiled kernels and autotuning: the hybrid's first replica took 255-347 s on a fresh machine,
# later ones about 60 s) goes from one machine to the next: `wait` packs ~/.triton/cache, once the chain is done,
# into $OUT/triton-cache.tar.gz (where it is under the trip back's 16 MiB), and `start` unpacks a carried
# .gpu-bundle/triton-cache.tar.gz before the first config. Triton keys each kernel by its source, GPU and version,
# so a cache from another machine is used only where it matches.
set -uo pipefail
root=${DEVICE_CHAIN_ROOT:-/root}  # the device machine's; a test's own folder
keep=$root/keep
triton=.gpu-bundle/triton-cache.tar.gz
case ${1:-} in
start)
  deadline=$2; cap=$3; shift 3
  mkdir -p "$root/repo" "$keep"
  if [ -f "$triton" ]; then  # unpacked aside and moved in whole: a damaged tarball leaves no half-written kernel
    aside=$(mktemp -d)
    if tar -C "$aside" -xzf "$triton" && [ -d "$aside/cache" ]; then
      mkdir -p "$HOME/.triton/cache" && cp -a "$aside/cache/." "$HOME/.triton/cache/" &&
        echo "device_chain: Triton's cache from an earlier machine, $(find "$aside/cache" -type f | wc -l) files"
    else
      echo "device_chain: $triton is not a Triton cache this script packed; kernels compile afresh" >&2
    fi
    rm -rf "$aside"
  fi
  tar -C "$(pwd)" --exclude=./.gpu-bundle -cf - . | tar -C "$root/repo" -xf -
  setsid nohup bash "$root/repo/bench/device_chain.sh" run "$deadline" "$cap" "$@" >"$keep/chain.log" 2>&1 </dev/null &
  echo "device_chain: started, log $keep/chain.log"
  ;;
run)
  deadline=$2; cap=$3; shift 3
  cd "$root/repo" || exit 1
  export OUT=$keep
  for item in "$@"; do
    left=$((deadline - $(date +%s)))
    [ "$left" -gt "$cap" ] && left=$cap
    if [ "$left" -lt 200 ]; then echo "device_chain: no time left for $item"; continue; fi
    echo "device_chain: ${item%%:*} for $left s from $(date +%T)"
    bash bench/device_run.sh "${item%%:*}" "$left" "${item#*:}"
    echo "device_chain: ${item%%:*} ended ($?) at $(date +%T)"
    cap=$deadline  # only the first is capped below the deadline
  done
  echo "device_chain: done at $(date +%T)"
  ;;
wait)
  end=$(($(date +%s) + $2))
  while [ "$(date +%s)" -lt "$end" ] && ! grep -q "^device_chain: done" "$keep/chain.log" 2>/dev/null; do sleep 5; done
  tail -n 20 "$keep/chain.log"
  cp "$keep"/*.tar.gz "$keep/chain.log" "$OUT"/ 2>/dev/null
  if grep -q "^device_chain: done" "$keep/chain.log" 2>/dev/null && [ -d "$HOME/.triton/cache" ]; then
    tar -C "$HOME/.triton" -czf "$root/triton-cache.tar.gz" cache
    size=$(stat -c %s "$root/triton-cache.tar.gz")
    echo "device_chain: Triton's cache packed, $size bytes"
    [ "$size" -lt $((16 * 1024 * 1024)) ] && cp "$root/triton-cache.tar.gz" "$OUT"/
  fi
  ls -la "$OUT"
  ;;
*)
  echo "usage: bash bench/device_chain.sh start DEADLINE CAP CONFIG:TARGET... | wait SECONDS" >&2
  exit 2
  ;;
esac

#!/bin/bash
# Run kvpool on a lent GPU machine (the device tool) and pack what it measured into $OUT.
#   bash bench/device_run.sh CONFIG SECONDS [snakemake targets or flags...]
# Resumable: every call works in /root/work/<config name>, so a later call (the machine still
# warm) goes on from the outputs already there. Snakemake gets SIGINT at SECONDS, which stops
# the fleet cleanly (every replica is in its own process group and would outlive a SIGKILL).
# Leave SECONDS at least 90 s below the device call's limit: stopping a fleet and packing the
# results take that long, and a call cut off by its limit brings nothing back.
# A cell's gate needs the split-matched reference (results/reference/), which Snakemake may schedule
# after the cells' fleets: in a call the budget cuts short, name the reference or one cell's
# validity.json first with --prioritize so that one cell finishes whole.
# The device gets the working tree with a stale .git: name the commit, as the call's command
# written here, KVPOOL_GIT_COMMIT=<git rev-parse HEAD> KVPOOL_GIT_DIRTY=<0 or 1: uncommitted changes
# in the tree sent> bash bench/device_run.sh ...
# Longer than one device call: bench/device_chain.sh runs this detached, config after config.
# Longer than a session's device time: put the two tarballs a run packs (bench/device_resume.sh) in .device-resume/
# here and carry that folder; the next machine's run goes on from the steps that finished. A session's checkout
# keeps no ignored folder: commit the run cut short from its first tarball as docs/results/<config name>/, carry
# that, and name it, KVPOOL_RESUME_FROM=docs/results/<config name>: the prompts and the model are built again
# here and held to the digests the last machine wrote.
set -uo pipefail
config=$1; budget=$2; shift 2
repo=$(pwd)
name=$(basename "$config" .yaml)
work=/root/work/$name
export PYTHONPATH=/root/site:$repo/src PATH=/root/site/bin:$PATH PYTHONUNBUFFERED=1
mkdir -p "$work"
# kvpool's vLLM plugin (the kvpool-random loader of a model with drawn weights) is found through the package's
# entry point: install kvpool itself (editable, offline, no dependencies) into the machine's python.
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e "$repo" ||
  echo "device_run: kvpool not installed: a model with drawn weights (random_model.weights) cannot load" >&2
resume_from=${KVPOOL_RESUME_FROM:-}
if [ -n "$resume_from" ] && [ "$(basename "$resume_from")" != "$name" ]; then
  echo "device_run: KVPOOL_RESUME_FROM names $resume_from, not a run of $name: $name starts afresh" >&2
  resume_from=
fi
if [ ! -d "$work/results" ]; then
  if [ -f "$repo/.device-resume/$name.tar.gz" ]; then
    bash "$repo/bench/device_resume.sh" unpack "$repo/.device-resume" "$work" "$name" || exit 2
  elif [ -n "$resume_from" ]; then
    bash "$repo/bench/device_resume.sh" unpack "$repo/$resume_from" "$work" "$name" \
      python3 -m snakemake --cores 1 -s "$repo/Snakefile" --configfile "$repo/$config" || exit 2
  fi
fi
[ -n "${KVPOOL_GIT_COMMIT:-}" ] || echo "device_run: KVPOOL_GIT_COMMIT is unset; manifests will record this copy's stale .git" >&2
# A replica (or an LMCache MP server) left by an earlier call of this config that was cut off would
# hold GPU memory. Only those are stopped: kvpool starts them in the run's working directory.
ours() { for pid in $(pgrep -f "vllm serve|lmcache server"); do
  [ "$(readlink "/proc/$pid/cwd")" = "$work" ] && echo "$pid"; done; }
left=$(ours); [ -n "$left" ] && kill -INT $left && sleep 10
left=$(ours); [ -n "$left" ] && kill -KILL $left
# A call cut off by the device's limit leaves Snakemake's lock behind; nothing else runs here.
pgrep -f "python3 -m snakemake" >/dev/null || rm -rf "$work/.snakemake/locks"
timeout -s INT "$budget" python3 -m snakemake --cores 1 -s "$repo/Snakefile" --directory "$work" \
  --configfile "$repo/$config" --rerun-incomplete --rerun-triggers=mtime "$@"
rc=$?
nvidia-smi --query-gpu=index,memory.used --format=csv,noheader
bash "$repo/bench/device_resume.sh" pack "$work" "$OUT" "$name"
ls -la "$OUT"
exit $rc

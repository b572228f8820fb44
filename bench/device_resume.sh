#!/bin/bash
# Carry a run from one lent GPU machine to the next: a session's device time is 30 minutes, and a long shape's
# model check, reference and cells take more.
#   bash bench/device_resume.sh pack WORK OUT NAME      WORK's run into OUT/NAME.tar.gz and OUT/NAME.resume.tar.gz
#   bash bench/device_resume.sh unpack FROM WORK NAME [REBUILD...]   FROM's run into WORK, which holds no results yet
# NAME.tar.gz is what a committed run keeps (results, logs, benchmarks, Snakemake's log, resume/), without the
# workload files and the model. NAME.resume.tar.gz holds those, a written model's weights only up to 64 MiB a file:
# the trip back from the device takes 16 MiB a file. Unpacked, every output keeps its time, so Snakemake with mtime
# triggers (bench/device_run.sh) reruns no step that finished, and each cell is held to the reference measured
# before it.
# FROM is either the folder holding the two tarballs or a run committed from NAME.tar.gz alone (docs/results/NAME):
# a checkout keeps neither ignored files nor times, so pack also writes resume/times.tsv (every file's time) and
# resume/SHA256SUMS (the files left out of NAME.tar.gz). From a committed run, REBUILD (a Snakemake command line,
# given --directory and the targets) builds those files again; each must match its digest, and none may lack one
# (a written model's weights over 64 MiB), or nothing goes on.
set -uo pipefail
# Built by the workflow from the config alone, and too large to commit: the tarball for the next machine holds them.
rebuildable=(results/workload/prompts.jsonl results/studyb/workload.json resources)

refuse() {
  echo "device_resume: $*" >&2
  [ -n "${staged:-}" ] && rm -rf "$staged" "$staged.rebuild.log"
  exit 2
}

# The committed run's copy of a packed path: Snakemake's own logs are committed as snakemake-log/.
committed_path() {
  case $1 in
  .snakemake/log/*) echo "snakemake-log/${1#.snakemake/log/}" ;;
  *) echo "$1" ;;
  esac
}

# The Snakemake target that builds a rebuildable file.
target_of() {
  case $1 in
  resources/model/*) echo resources/model ;;
  *) echo "$1" ;;
  esac
}

case ${1:-} in
pack)
  work=$2 out=$(realpath -m "$3") name=$4
  cd "$work" || exit 2
  mkdir -p resume
  kept=$(ls -d results logs benchmarks .snakemake/log 2>/dev/null)
  again=$(ls -d "${rebuildable[@]}" 2>/dev/null)
  # shellcheck disable=SC2086  # word lists of paths without spaces
  find $kept $again -type f ! -size +64M -printf '%T@\t%p\n' | sort -k2 >resume/times.tsv
  # shellcheck disable=SC2086
  find $again -type f ! -size +64M -print0 | sort -z | xargs -0 -r sha256sum >resume/SHA256SUMS
  left_out=(--exclude="*.safetensors")
  for path in "${rebuildable[@]}"; do left_out+=(--exclude="$path"); done
  # shellcheck disable=SC2086
  tar -czf "$out/$name.tar.gz" "${left_out[@]}" $kept resume
  big=()
  while IFS= read -r path; do big+=("--exclude=$path"); done < <(find resources -name "*.safetensors" -size +64M 2>/dev/null)
  # shellcheck disable=SC2086
  tar -czf "$out/$name.resume.tar.gz" "${big[@]}" $again
  ;;
unpack)
  from=$(realpath -m "$2") work=$(realpath -m "$3") name=$4
  shift 4
  rebuild=("$@")
  if [ -e "$work/results" ]; then
    echo "device_resume: $work already holds results; nothing unpacked over them" >&2
    exit 2
  fi
  [ -d "$from" ] || { echo "device_resume: cannot resume $name: $from is not a folder" >&2; exit 2; }
  mkdir -p "$work"
  # unpacked beside WORK first: a source that fails or a model that cannot go on leaves WORK as it was
  # interrupted (Ctrl-C while a rebuild runs, or before): nothing half-unpacked stays beside WORK
  staged=
  trap 'rm -rf ${staged:+"$staged" "$staged.rebuild.log"}; exit 130' INT TERM
  staged=$(mktemp -d "$work.unpacking.XXXX")
  if [ -f "$from/resume/times.tsv" ] && [ ! -f "$from/$name.tar.gz" ]; then
    sums=$from/resume/SHA256SUMS
    [ -f "$sums" ] || refuse "$from holds resume/times.tsv without resume/SHA256SUMS"
    declare -A rebuilt=()
    while IFS= read -r path; do rebuilt[$path]=1; done < <(cut -c67- "$sums")
    [ ${#rebuild[@]} -gt 0 ] || refuse "resuming $name from the committed run $from needs a command to rebuild" \
      "${!rebuilt[*]}"
    targets=$(for path in "${!rebuilt[@]}"; do target_of "$path"; done | sort -u)
    # shellcheck disable=SC2086  # targets are paths without spaces
    "${rebuild[@]}" --directory "$staged" $targets >"$staged.rebuild.log" 2>&1 ||
      refuse "rebuilding $(echo $targets) for $name failed: $(tail -n 5 "$staged.rebuild.log")"
    rm -rf "$staged/.snakemake" "$staged.rebuild.log"
    # shellcheck disable=SC2086
    unchecked=$(cd "$staged" && find $targets -type f | while IFS= read -r path; do
      [ -n "${rebuilt[$path]:-}" ] || echo "$path"; done)
    [ -z "$unchecked" ] || refuse "cannot resume $name from $from: the last machine kept no digest of" \
      "$(echo $unchecked) (over 64 MiB: weights written there), so what is built here cannot be held to it" \
      "(carry .device-resume/ instead)"
    differ=$(cd "$staged" && sha256sum -c "$sums" 2>/dev/null | grep -v ': OK$')
    # a model's config.json names the transformers that wrote it: the usual cause is other software here
    wrote=$(grep -o '"transformers_version": "[^"]*"' "$staged/resources/model/config.json" 2>/dev/null | cut -d'"' -f4)
    case $differ in *resources/model/config.json:*) [ -n "$wrote" ] && differ="$differ (rebuilt by transformers\
 $wrote here; config.json records the version that writes it: resume with the last machine's software)" ;; esac
    [ -z "$differ" ] || refuse "cannot resume $name: rebuilt here, these differ from what the last machine" \
      "measured with: $differ"
    mkdir -p "$staged/resume" && cp -p "$from"/resume/* "$staged/resume/"
    while IFS=$'\t' read -r _ path; do
      [ -n "${rebuilt[$path]:-}" ] && continue
      source=$from/$(committed_path "$path")
      [ -f "$source" ] || refuse "cannot resume $name: $from lacks $(committed_path "$path"), which the run had"
      mkdir -p "$staged/$(dirname "$path")" && cp "$source" "$staged/$path"
    done <"$from/resume/times.tsv"
    # a checkout's files carry the checkout's time: each gets the time it had on the machine that made it
    while IFS=$'\t' read -r time path; do touch -m -d "@$time" "$staged/$path"; done <"$from/resume/times.tsv"
  elif [ -d "$from/results" ] && [ ! -f "$from/$name.tar.gz" ]; then
    refuse "cannot resume $name from $from: a committed run without resume/times.tsv (packed before runs kept" \
      "their files' times and digests) cannot go on; run it afresh"
  else
    for part in "$name.tar.gz" "$name.resume.tar.gz"; do
      tar -C "$staged" -xzf "$from/$part" || refuse "cannot unpack $from/$part"
    done
    model=$staged/resources/model
    if grep -q '"weights": "written"' "$model/kvpool-model.json" 2>/dev/null &&
      ! ls "$model"/*.safetensors >/dev/null 2>&1; then
      refuse "cannot resume $name: its model's weights were written on the last machine and were" \
        "too large to come back (random_model.weights: drawn has none to carry)"
    fi
  fi
  cp -a "$staged"/. "$work"/ && rm -rf "$staged"
  echo "device_resume: $name goes on from $(cd "$work/results" && ls | tr '\n' ' ')"
  ;;
*)
  echo "usage: bash bench/device_resume.sh pack WORK OUT NAME | unpack FROM WORK NAME [REBUILD...]" >&2
  exit 2
  ;;
esac

#!/bin/bash
# Carry a run from one lent GPU machine to the next: a session's device time is 30 minutes, and a long shape's
# model check, reference and cells take more.
#   bash bench/device_resume.sh pack WORK OUT NAME      WORK's run into OUT/NAME.tar.gz and OUT/NAME.resume.tar.gz
#   bash bench/device_resume.sh unpack FROM WORK NAME   FROM's two tarballs into WORK, which holds no results yet
# NAME.tar.gz is what a committed run keeps (results, logs, benchmarks, Snakemake's log), without the prompts and
# the model. NAME.resume.tar.gz holds those two, a written model's weights only up to 64 MiB a file: the trip back
# from the device takes 16 MiB a file. Unpacked, every output keeps its time, so Snakemake with mtime triggers
# (bench/device_run.sh) reruns no step that finished, and each cell is held to the reference measured before it.
set -uo pipefail
case ${1:-} in
pack)
  work=$2 out=$3 name=$4
  tar -C "$work" -czf "$out/$name.tar.gz" --exclude=results/workload/prompts.jsonl --exclude="*.safetensors" \
    $(cd "$work" && ls -d results logs benchmarks .snakemake/log 2>/dev/null)
  big=()
  while IFS= read -r path; do big+=("--exclude=$path"); done < <(cd "$work" &&
    find resources -name "*.safetensors" -size +64M 2>/dev/null)
  tar -C "$work" -czf "$out/$name.resume.tar.gz" "${big[@]}" \
    $(cd "$work" && ls -d results/workload/prompts.jsonl resources 2>/dev/null)
  ;;
unpack)
  from=$2 work=$3 name=$4
  if [ -e "$work/results" ]; then
    echo "device_resume: $work already holds results; nothing unpacked over them" >&2
    exit 2
  fi
  mkdir -p "$work"
  # unpacked beside WORK first: a tarball that fails or a model that cannot go on leaves WORK as it was
  staged=$(mktemp -d "$work.unpacking.XXXX")
  for part in "$name.tar.gz" "$name.resume.tar.gz"; do
    if ! tar -C "$staged" -xzf "$from/$part"; then
      echo "device_resume: cannot unpack $from/$part" >&2
      rm -rf "$staged"
      exit 2
    fi
  done
  model=$staged/resources/model
  if grep -q '"weights": "written"' "$model/kvpool-model.json" 2>/dev/null &&
    ! ls "$model"/*.safetensors >/dev/null 2>&1; then
    echo "device_resume: cannot resume $name: its model's weights were written on the last machine and were" \
      "too large to come back (random_model.weights: drawn has none to carry)" >&2
    rm -rf "$staged"
    exit 2
  fi
  cp -a "$staged"/. "$work"/ && rm -rf "$staged"
  echo "device_resume: $name goes on from $(cd "$work/results" && ls | tr '\n' ' ')"
  ;;
*)
  echo "usage: bash bench/device_resume.sh pack WORK OUT NAME | unpack FROM WORK NAME" >&2
  exit 2
  ;;
esac

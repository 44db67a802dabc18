#!/usr/bin/env bash
# A folder as one tar.xz cut into pieces that each travel in one call to the offline host:
#
#   bash benchmarks/offline/pack_parts.sh KIT wheels 58MB   # KIT/wheels -> KIT/part1/vllm.tar.xz.0, KIT/part2/...
#
# SIZE: a piece's size at most, as split's -b reads it (58MB: 58,000,000 bytes). Each part holds its piece, the whole
# file's sha256 and the number of pieces, so the install (benchmarks/offline/vllm_install.sh) knows when it has them all.
set -euo pipefail
kit=$1 folder=$2 size=$3
rm -rf "$kit"/part[0-9]*
tar -C "$kit" -cf - "$folder" | xz -9 -T0 > "$kit/vllm.tar.xz"
split -b "$size" -d -a 1 "$kit/vllm.tar.xz" "$kit/vllm.tar.xz."
pieces=("$kit"/vllm.tar.xz.[0-9])
sha256sum "$kit/vllm.tar.xz" | cut -d' ' -f1 > "$kit/vllm.sha256"
for i in "${!pieces[@]}"; do
  part=$kit/part$((i + 1))
  mkdir -p "$part"
  mv "${pieces[$i]}" "$part/"
  cp "$kit/vllm.sha256" "$part/"
  echo "${#pieces[@]}" > "$part/pieces.txt"
done
rm "$kit/vllm.tar.xz" "$kit/vllm.sha256"
du -sb "$kit"/part[0-9]* | awk '{printf "%s: %.1f MB\n", $2, $1 / 1e6}'

#!/usr/bin/env bash
# Emits the named list of program texts that a refactor must leave alone, and their sha256:
# every program at the primary and primary-packed shapes, f32 and bf16, for the xla, mosaic and
# interpret implementations, and the same programs in their 2-device context-parallel form.
# Nothing is compiled (no libtpu needed). Compare two commits with
#   xtask/scripts/emit-programs.sh DIR_A   # at the first commit
#   xtask/scripts/emit-programs.sh DIR_B   # at the second
#   diff DIR_A/SHA256SUMS DIR_B/SHA256SUMS
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-target/programs}
rm -rf "$out"
mkdir -p "$out"
for implementation in xla mosaic interpret; do
    for devices in 1 2; do
        cargo xtask aot --emit "$out" --program all --shape primary,primary-packed --dtype both \
            --implementation "$implementation" --devices "$devices"
    done
done
(cd "$out" && sha256sum -- *.mlir) > "$out/SHA256SUMS"
echo "$(wc -l < "$out/SHA256SUMS") program texts; sha256 in $out/SHA256SUMS"

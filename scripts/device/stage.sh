#!/usr/bin/env bash
# Files larger than one device call can carry (a GGUF, a CUDA binary), cut into calls that fit.
# A call carries the working tree and its `carry` paths, 64 MiB in all; the device machine's /tmp
# survives between calls while it stays warm (30 s), so the parts go there one call after another
# and the last call joins them (../shared/DEVICE.md, "Files over the carry limit").
#
#   scripts/device/stage.sh FILE...
#
# Writes .device/stage/1, 2, … (each fits one call beside the tree: parts of one tar stream that
# holds the files and their SHA256SUMS, and the count of parts), then prints the calls; on the
# device scripts/device/join.sh gathers the parts and, with the last, joins and checks them.
# .device/ must be ignored by git (e.g. in .git/info/exclude) so the folders travel only when named.
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: $0 FILE..." >&2; exit 2; }
root=$(git rev-parse --show-toplevel)
cd "$root"
git check-ignore -q .device || { echo ".device/ is not ignored by git: add it to .git/info/exclude" >&2; exit 1; }
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
# 64 MiB less the tree and a margin for untracked files that travel too.
room=$(( 64 * 1024 * 1024 - tree - 2 * 1024 * 1024 ))
[ "$room" -gt $(( 4 * 1024 * 1024 )) ] || { echo "the tree ($tree bytes) leaves no room to carry parts" >&2; exit 1; }
out=.device/stage
rm -rf "$out"; mkdir -p "$out"
# One tar stream of every file and its checksum, cut into parts of the room a call leaves: as few
# calls as the bytes allow.
sums=$(mktemp -d); trap 'rm -rf "$sums"' EXIT
args=()
for f in "$@"; do
  [ -f "$f" ] || { echo "$f: no such file" >&2; exit 1; }
  (cd "$(dirname "$f")" && sha256sum "$(basename "$f")") >> "$sums/SHA256SUMS"
  args+=(-C "$(cd "$(dirname "$f")" && pwd)" "$(basename "$f")")
done
tar -cf - -C "$sums" SHA256SUMS "${args[@]}" | split -b "$room" -d -a 3 - "$out/stage.tar.part"
n=0
for p in "$out"/stage.tar.part*; do n=$((n + 1)); mkdir -p "$out/$n"; mv "$p" "$out/$n/"; done
# Each part says how many there are, so that scripts/device/join.sh knows when it has them all.
for i in $(seq 1 "$n"); do echo "$n" > "$out/$i/parts"; done
echo "$n calls, back to back (carry, command):"
for i in $(seq 1 "$n"); do
  echo "  [\"$out/$i\"]  bash scripts/device/join.sh"
done
echo "The call that carries the last part joins and checks them in /tmp/stage (a later call may run"
echo "there at once: join.sh is a no-op once joined)."

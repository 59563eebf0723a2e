#!/usr/bin/env bash
# The device side of scripts/device/stage.sh: copies the parts this call carries (.device/stage/N)
# into /tmp/stage, which survives between calls while the machine stays warm, and once every part
# is there joins the tar stream and checks each file against its SHA256SUMS. Idempotent: with the
# files joined already it only says so. Exits non-zero when a check fails.
#
#   bash scripts/device/join.sh        # in every staging call; the files are in /tmp/stage after the last
set -euo pipefail
dest=${STAGE_DIR:-/tmp/stage}
mkdir -p "$dest"
for d in .device/stage/*/; do
  [ -d "$d" ] || continue
  cp "$d"stage.tar.part* "$dest/"
  cp "$d"parts "$dest/parts"
done
cd "$dest"
if [ -f joined ]; then
  echo "joined already in $dest"
  exit 0
fi
[ -f parts ] || { echo "no parts carried and nothing joined in $dest" >&2; exit 1; }
have=$(find . -maxdepth 1 -name 'stage.tar.part*' | wc -l)
want=$(cat parts)
if [ "$have" -lt "$want" ]; then
  echo "$have of $want parts in $dest"
  exit 0
fi
cat stage.tar.part* | tar -x
rm stage.tar.part*
sha256sum -c SHA256SUMS
touch joined

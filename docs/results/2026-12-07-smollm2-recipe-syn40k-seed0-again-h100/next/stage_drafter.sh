# Stages the recipe drafter of session 46 (seed 0 of the 40,000 recipe, brought back in parts: the README beside this
# folder) on the GPU machine: each call carries some of .stage/drafter-syn40k-seed0/ (run-slim.tar.gz, the run
# folder's small files without its TensorBoard events and metrics; export_best.tar.part00-02, the export_best/ it
# evaluates with export/done.json and checkpoints/settings.json); this copies what the call carried to $PARTS, outside
# the repository copy, so that it survives the next call, and once all four are there unpacks the run folder into
# $RUN_DIR with its drafter:   bash stage_drafter.sh
set -euo pipefail
src=.stage/drafter-syn40k-seed0
PARTS=${PARTS:-/tmp/drafter-parts}
RUN_DIR=${RUN_DIR:-/tmp/runs/seed0}
mkdir -p "$PARTS"
for file in run-slim.tar.gz export_best.tar.part00 export_best.tar.part01 export_best.tar.part02; do
  if [ -f "$src/$file" ]; then cp "$src/$file" "$PARTS/"; fi
done
missing=$(for file in run-slim.tar.gz export_best.tar.part00 export_best.tar.part01 export_best.tar.part02; do
  [ -f "$PARTS/$file" ] || echo "$file"; done)
if [ -n "$missing" ]; then
  echo "drafter: waiting for" $missing
  exit 0
fi
sums=$(cd "$(dirname "$0")" && pwd)/drafter.sha256   # recorded when the parts were made (never trust a transfer)
(cd "$PARTS" && sha256sum --quiet -c "$sums") || { echo "drafter: a part differs from drafter.sha256"; exit 1; }
if [ ! -f "$RUN_DIR/export_best/model.safetensors" ]; then
  mkdir -p "$(dirname "$RUN_DIR")"
  tar -C "$(dirname "$RUN_DIR")" -xzf "$PARTS/run-slim.tar.gz"
  cat "$PARTS"/export_best.tar.part* | tar -C "$RUN_DIR" -xf -
fi
echo "drafter staged: $(du -sh "$RUN_DIR/export_best" | cut -f1) in $RUN_DIR/export_best"

# Run NAME of the GPU default in /tmp/runs/NAME, from run A's finished data (its data stage is then "up to date"),
# or with FRESH=1 from nothing (for overrides that change the data; session 36), with the overrides $2; waited for up
# to $3 seconds (detached: a call that ends leaves it running), then its small files collected into $OUT/NAME/. Again
# with the same NAME: only waits and collects.
#   bash .gpu/variant.sh B "train.max_minutes=7.25 train.profile_steps=1001:5" 560
name=$1; overrides=$2; limit=${3:-540}; run=/tmp/runs/$name
test -f /tmp/exp/done || { echo "run A not done"; exit 1; }
if [ ! -d $run ]; then
  mkdir -p $run
  [ "${FRESH:-0}" = 1 ] || cp -r /tmp/runs/quick/data $run/
  cat > /tmp/exp/run$name.sh <<RUN
export PYTHONPATH=/tmp/dflash-stage/site:/tmp/site:/tmp/repo PYTHONUNBUFFERED=1
cd /tmp/repo; t0=\$(date +%s)
python3 -m dflash.train +experiment=smollm2_quick run_dir=$run show_progress=false logging.wandb.mode=disabled \
  $overrides > /tmp/exp/recipe$name.log 2>&1
echo "RECIPE $name rc=\$? wall_s=\$(( \$(date +%s) - t0 ))" > /tmp/exp/done$name
RUN
  setsid nohup bash /tmp/exp/run$name.sh > /tmp/exp/run$name.log 2>&1 < /dev/null &
  echo "started $name: $overrides"
fi
t=0; while [ ! -f /tmp/exp/done$name ] && [ $t -lt $limit ]; do sleep 10; t=$((t + 10)); done
cat /tmp/exp/done$name 2>/dev/null; tail -n 25 /tmp/exp/recipe$name.log
mkdir -p $OUT/$name && cp /tmp/exp/recipe$name.log /tmp/exp/run$name.log $OUT/$name/ 2>/dev/null
tar -C /tmp/runs -czf $OUT/$name/run.tar.gz --exclude=checkpoints --exclude='export*' --exclude=dataset \
  --exclude=synthetic.jsonl --exclude='*.arrow' --exclude=feature_cache --exclude=features --exclude=tensorboard \
  --exclude=journal.jsonl $name
ls -la $OUT/$name

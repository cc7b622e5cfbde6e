# Packs the run's small files, the logs, the data journal and (COLLECT_EXPORT=1) the exported drafter into $OUT.
RUN=/tmp/runs/quick
mkdir -p $OUT/exp
cp /tmp/exp/*.log $OUT/exp/ 2>/dev/null
tar -C /tmp -czf $OUT/exp/results.tar.gz --exclude='checkpoints' --exclude='export*' --exclude='feature_cache' \
  --exclude='*.arrow' --exclude='journal.jsonl' --exclude='*.safetensors' --exclude='*.pt' exp runs 2>/dev/null
ls -la $OUT/exp
if [ "${COLLECT_EXPORT:-0}" = 1 ]; then
  j=$(ls $RUN/data/journal.jsonl 2>/dev/null) && xz -T8 -6 -c $j > /tmp/journal.jsonl.xz && \
    split -b 15000000 -d -a 1 /tmp/journal.jsonl.xz $OUT/exp/journal.xz.part
  test -d $RUN/export_best && tar -C $RUN -cf - export_best | split -b 15000000 -d -a 1 - $OUT/exp/export_best.tar.part
  ls -la $OUT/exp
fi

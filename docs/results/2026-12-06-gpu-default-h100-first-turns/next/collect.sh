# Packs the run's small files and the logs into $OUT, and with COLLECT_EXPORT=1 the exported drafter (export_best) in
# parts of 15 MB (for live decoding in a later session: carry it back as an ignored folder).
RUN=${RUN:-/tmp/runs/quick}
mkdir -p $OUT/exp
cp /tmp/exp/*.log $OUT/exp/ 2>/dev/null
tar -C /tmp -czf $OUT/exp/results.tar.gz --exclude='checkpoints' --exclude='export*' --exclude='feature_cache' \
  --exclude='*.arrow' --exclude='journal.jsonl' --exclude='*.safetensors' --exclude='*.pt' --exclude='dataset' \
  --exclude='synthetic.jsonl' exp runs 2>/dev/null
if [ "${COLLECT_EXPORT:-0}" = 1 ] && [ -d $RUN/export_best ]; then
  tar -C $RUN -cf - export_best | split -b 15000000 -d -a 1 - $OUT/exp/export_best.tar.part
fi
ls -la $OUT/exp

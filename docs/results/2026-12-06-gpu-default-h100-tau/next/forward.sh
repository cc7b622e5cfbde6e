# After run A, before the next run starts: the colocated target forward with and without capture.cuda_graphs,
# eager and compiled layers (bench/colocated_forward.py, the GPU default's 32 rows), into $OUT/forward/.
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/dflash-stage/site:/tmp/site:/tmp/repo
mkdir -p $OUT/forward && cd /tmp/repo
timeout 150 python3 bench/colocated_forward.py --out $OUT/forward/eager.json > $OUT/forward/eager.log 2>&1
timeout 200 python3 bench/colocated_forward.py --compile --out $OUT/forward/compiled.json \
  > $OUT/forward/compiled.log 2>&1
for f in eager compiled; do python3 -c "import json,sys; r=json.load(open('$OUT/forward/$f.json')); \
print('$f', {k: {m: round(v, 2) for m, v in p.items()} for k, p in r['paths'].items()})" || tail -5 $OUT/forward/$f.log; done

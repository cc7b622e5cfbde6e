"""Replay estimate at T on CPU: sampled vs coupled drafts (coupled_drafts.patch applied), the session-19 GPU default drafter
unpacked at .exp/s19/runs/quick/export_best. Usage: python coupled_probe.py PROMPTS_PER_SET NEW_TOKENS T RULE[,RULE]."""
import sys, time, json
import torch
from dflash.config import compose
from dflash.stages.context import RunContext
from dflash.eval.export import load_drafter
from dflash.eval.evaluate import load_prompt_sets
from dflash.eval.replay_estimate import replay_estimate
from dflash.eval.expected_acceptance import expected_metrics

limit, new, T = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
rules = sys.argv[4].split(",")
torch.set_num_threads(2)
run = RunContext(compose(["+experiment=smollm2_quick", "device=cpu", "run_dir=.exp/s19/runs/quick"]))
target = run.target
drafter = load_drafter(".exp/s19/runs/quick/export_best", dtype=torch.float32, device="cpu")
specs = {n: {"source": n, "limit": limit} for n in ("humaneval", "mtbench", "gsm8k")}
sets, _ = load_prompt_sets(target, specs, max_new_tokens=new)
out = {}
for rule in rules:
    sampling, _, dt = rule.partition("@")
    res = {}
    for name, prompts in sets.items():
        t0 = time.time()
        traces = replay_estimate(drafter, target, prompts, max_new_tokens=new, temperature=T, draft_sampling=sampling,
                                 draft_temperature=float(dt) if dt else None, seed=0, batch_size=8)
        m = expected_metrics(traces, drafter.config.block_size)
        res[name] = {"tau": m["tau"], "per_position": [round(x, 4) for x in m["per_position"][:5]]}
        print(rule, name, round(m["tau"], 4), res[name]["per_position"], f"{time.time()-t0:.0f}s", flush=True)
    out[rule] = res
json.dump(out, open(f"/tmp/coupled_probe_{limit}_{new}_{T}.json", "w"), indent=1)

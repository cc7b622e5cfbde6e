"""Evaluator speed on one GPU with the SmolLM2 target: live speculative vs target-only decoding, and replay timing.

    python bench/eval_speed.py                                   # random drafter + oracle drafts, defaults below
    python bench/eval_speed.py --drafter runs/smollm2/export     # a trained drafter (z-lab folder), live + replay
    python bench/eval_speed.py --drafter runs/smollm2/export --live-drafters trained,oracle,random
    python bench/eval_speed.py --drafter runs/smollm2/export --live-engine hf,static   # both target engines
    python bench/eval_speed.py --device cpu --replay-prompts 4 --live-prompts 2 --max-new-tokens 32   # smoke test

Prints one JSON object (and writes it to --out when given). Live rows decode --live-prompts prompts one at a time,
each target-only and speculative in the same process, after a warm-up; "speedup" = target-only time per token /
speculative time per token. Drafters measured live (--live-drafters; default "trained" with --drafter, else
"random,oracle"):
- "random": an untrained drafter (tau ~ 1): the loop's overhead when nothing is accepted;
- "oracle": the untrained drafter's forward still runs (same cost), but its logits are replaced by the target's
  own greedy tokens, so every draft is accepted (tau ~ block size): the most this loop can gain on this hardware;
- "trained": the drafter of --drafter.
Each drafter is measured with each target engine of --live-engine (comma list of auto, hf, static; live.py): "hf"
drives the HF model over a DynamicCache, "static" a static KV cache whose verify and one-token steps replay CUDA
graphs (what a serving engine does); rows are keyed "drafter/engine" and say which engine ran. Graph capture
happens before each decode's clock starts, once per process.
Each live row also decodes its first --profile-prompts prompts once more with a device sync around every phase of
a step ("steps": seconds per phase: prefill, draft, verify, accept, rollback), kept out of the speedup.
On CUDA each live row also decodes its first prompt twice more for "step_breakdown" (at T=0, and at
--profile-temperature with --profile-draft-sampling drafts when that is > 0): milliseconds per step of each part,
timed by CUDA events without syncs (draft_block: the drafter's block step from the block's tokens through the
embedding, the drafter, lm_head and argmax, one graph on the static engine (in a checkout from before that graph,
the drafter's block forward alone); draft: that plus the choice of drafts; verify: the target's block forward;
accept: the acceptance rule and its host round trip; rollback: the target rollback and the drafter context
extend; between: the rest of the step's wall time, host bookkeeping with the device idle), and the device syncs
per step, counted as the warnings of torch.cuda.set_sync_debug_mode("warn"). Only live_decode's `timer` phases are
relied upon, so this file also measures an older checkout of the library, before and after a change in one call:

    git archive COMMIT | tar -x -C before/    # here, into an untracked folder that travels with the tree
    cp bench/eval_speed.py before/bench/ && python before/bench/eval_speed.py --live-drafters random,oracle \
        --live-engine static --live-prompts 8 --replay-prompts 1 --profile-temperature 1.0 --out before.json
    python bench/eval_speed.py --live-drafters random,oracle --live-engine static --live-prompts 8 \
        --replay-prompts 1 --profile-temperature 1.0 --out after.json
Replay: the exact greedy replay (the evaluator's `evaluate`) over --replay-prompts prompts x --max-new-tokens tokens
(issue target: 100 x 256 in under a minute on one GPU), with its seconds per phase ("timing": generate,
target_pass, draft, accept). --replay-profile N replays N prompts twice more under torch.profiler ("replay_profile",
for the gathered and the fixed-shape drafting step: the drafting steps, and per step the wall and device
milliseconds, the operators, the kernel launches and the top operators).
--replay-drafting ("replay_drafting") replays the same prompts twice more, drafted by the gathered step and by the
fixed-shape step (dflash/eval/chunk_drafts.py, on CUDA one graph a chunk): seconds per phase, steps and tau of each.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from contextlib import contextmanager

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dflash.config import compose, settings_from  # noqa: E402
from dflash.data.prompts import load_prompts  # noqa: E402
from dflash.inference.static_decode import resolve_engine  # noqa: E402
from dflash.eval import live  # noqa: E402
from dflash.eval.evaluate import evaluate  # noqa: E402
from dflash.eval.metrics import PhaseTimer, acceptance_metrics  # noqa: E402
from dflash.eval.replay import DrafterProposer, replay  # noqa: E402
from dflash.eval.export import load_drafter  # noqa: E402
from dflash.inference.drafter_cache import CachedDrafter  # noqa: E402
from dflash.inference.static_drafter import StaticDrafter  # noqa: E402
from dflash.models.drafter import DFlashDraftModel  # noqa: E402
from dflash.models.targets import load_target  # noqa: E402
from dflash.stages.shapes import drafter_config, target_shape  # noqa: E402
from dflash.train.step_profile import PhaseCount, phase_counts  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--drafter", default=None, help="z-lab drafter folder (e.g. runs/NAME/export)")
    parser.add_argument("--block-size", type=int, default=16, help="block size of the untrained drafter")
    parser.add_argument("--prompt-source", default="humaneval", help="humaneval | mtbench | gsm8k | sharegpt")
    parser.add_argument("--replay-prompts", type=int, default=100)
    parser.add_argument("--live-prompts", type=int, default=8)
    parser.add_argument("--live-drafters", default=None, help="comma list of random, oracle, trained")
    parser.add_argument("--live-engine", default="auto", help="comma list of auto, hf, static (target engines)")
    parser.add_argument("--profile-prompts", type=int, default=2, help="live prompts decoded again, phase by phase")
    parser.add_argument("--profile-temperature", type=float, default=0.0,
                        help="> 0: also break a step down at this temperature (CUDA)")
    parser.add_argument("--profile-draft-sampling", default="greedy", help="greedy | sampled (with the above)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--replay-batch-size", type=int, default=64)
    parser.add_argument("--replay-drafting", action="store_true",
                        help="replay once more with each drafting step, gathered and fixed-shape (replay_drafting)")
    parser.add_argument("--replay-profile", type=int, default=0,
                        help="> 0: replay this many prompts once more under torch.profiler (report's replay_profile)")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    return parser.parse_args()


def untrained_drafter(adapter, block_size: int) -> DFlashDraftModel:
    settings = settings_from(compose(["target=smollm2", f"drafter.block_size={block_size}"]))
    drafter = DFlashDraftModel(drafter_config(settings, target_shape(adapter)))
    drafter.init_weights(0)
    return drafter.to(device=adapter.device, dtype=adapter.dtype).eval()


class EventPhases:
    """live_decode's `timer` on CUDA without syncs: a pair of CUDA events around each phase, read at the end."""

    def __init__(self) -> None:
        self.events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {}

    @contextmanager
    def phase(self, name: str):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self.events.setdefault(name, []).append((start, end))

    def milliseconds(self) -> dict[str, float]:
        torch.cuda.synchronize()
        return {name: sum(start.elapsed_time(end) for start, end in pairs) for name, pairs in self.events.items()}


@contextmanager
def drafter_blocks_timed(phases: EventPhases):
    """The drafter's block step (`draft` of either drafter context; `hidden`, the block forward alone, in a checkout
    from before `draft`) charged to the phase "draft_block"."""
    name = "draft" if hasattr(StaticDrafter, "draft") else "hidden"
    originals = {cls: getattr(cls, name) for cls in (StaticDrafter, CachedDrafter)}

    def timed(original):
        def step(self, *args):
            with phases.phase("draft_block"):
                return original(self, *args)
        return step

    try:
        for cls, original in originals.items():
            setattr(cls, name, timed(original))
        yield
    finally:
        for cls, original in originals.items():
            setattr(cls, name, original)


def step_breakdown(drafter, adapter, prompt: list[int], max_new_tokens: int, engine: str, temperature: float = 0.0,
                   draft_sampling: str = "greedy") -> dict:
    """One prompt decoded twice: milliseconds per step of each part (CUDA events) and the device syncs per step
    (sync debug warnings). Prefill is charged once per prompt, not per step."""
    options = dict(max_new_tokens=max_new_tokens, stop_token_ids=adapter.stop_token_ids(), target_engine=engine,
                   temperature=temperature, draft_sampling=draft_sampling)
    generator = torch.Generator(device=adapter.device).manual_seed(0) if temperature > 0 else None
    phases = EventPhases()
    with drafter_blocks_timed(phases):
        timed = live.live_decode(drafter, adapter, prompt, timer=phases, generator=generator, **options)
    spent = phases.milliseconds()
    steps = max(timed.trace.num_steps, 1)
    per_step = {name: round(ms / steps, 4) for name, ms in spent.items() if name != "live_prefill"}
    step_parts = sum(ms for name, ms in spent.items() if name not in ("live_prefill", "draft_block"))
    wall_per_step = (1000 * timed.seconds - spent.get("live_prefill", 0.0)) / steps
    per_step["between"] = round(wall_per_step - step_parts / steps, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            counted = live.live_decode(drafter, adapter, prompt, generator=generator, **options)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    return {"temperature": temperature, "draft_sampling": draft_sampling, "steps": timed.trace.num_steps,
            "tau": sum(timed.trace.committed) / steps, "wall_ms_per_step": round(wall_per_step, 4),
            "prefill_ms": round(spent.get("live_prefill", 0.0), 3),
            "ms_per_step": {name.removeprefix("live_"): ms for name, ms in per_step.items()},
            "syncs": syncs, "syncs_per_step": round(syncs / max(counted.trace.num_steps, 1), 3)}


def live_row(drafter, adapter, prompts: list[list[int]], max_new_tokens: int, oracle: bool,
             profile_prompts: int = 0, engine: str = "auto", breakdowns: tuple[tuple[float, str], ...] = ()) -> dict:
    stop_ids = adapter.stop_token_ids()
    # The drafting seam of live.py: draft_block gives (logits, argmax); a checkout from before it, logits alone.
    with_argmax = hasattr(live, "draft_block")
    seam = "draft_block" if with_argmax else "draft_block_logits"
    real_draft = getattr(live, seam)
    totals = {"target_seconds": 0.0, "target_tokens": 0, "speculative_seconds": 0.0, "speculative_tokens": 0,
              "steps": 0, "committed": 0, "lossless_mismatches": 0}
    timer, profiled_steps, engines, row_breakdowns = PhaseTimer(adapter.device), 0, set(), []
    try:
        for index, prompt in enumerate(prompts):
            plain = live.target_only_decode(adapter, prompt, max_new_tokens=max_new_tokens, stop_token_ids=stop_ids,
                                            target_engine=engine)
            if oracle:
                truth = list(prompt) + plain.continuation

                def draft(context, *args, truth=truth):
                    drafted = real_draft(context, *args)  # keep the drafter's cost
                    size = args[-1]
                    ids = [truth[min(context.length + k, len(truth) - 1)] for k in range(1, size)]
                    perfect = torch.full_like(drafted[0] if with_argmax else drafted, -1e4)
                    perfect[torch.arange(size - 1), torch.tensor(ids)] = 0.0
                    return (perfect, perfect.argmax(dim=-1)) if with_argmax else perfect

                setattr(live, seam, draft)
            # T=0: the drafts are the drafter's argmax whatever draft_sampling says.
            result = live.live_decode(drafter, adapter, prompt, max_new_tokens=max_new_tokens, stop_token_ids=stop_ids,
                                      target_engine=engine, draft_sampling="greedy")
            engines.update((plain.engine, result.engine))
            if index < profile_prompts:
                profiled = live.live_decode(drafter, adapter, prompt, max_new_tokens=max_new_tokens,
                                            stop_token_ids=stop_ids, timer=timer, target_engine=engine,
                                            draft_sampling="greedy")
                profiled_steps += profiled.trace.num_steps
            if index == 0 and adapter.device.type == "cuda" and breakdowns:
                row_breakdowns = [step_breakdown(drafter, adapter, prompt, max_new_tokens, engine, *setting)
                                  for setting in breakdowns]
            setattr(live, seam, real_draft)
            totals["target_seconds"] += plain.seconds
            totals["target_tokens"] += len(plain.continuation)
            totals["speculative_seconds"] += result.seconds
            totals["speculative_tokens"] += len(result.continuation)
            totals["steps"] += result.trace.num_steps
            totals["committed"] += sum(result.trace.committed)
            totals["lossless_mismatches"] += int(result.continuation != plain.continuation)
    finally:
        setattr(live, seam, real_draft)
    target_rate = totals["target_tokens"] / totals["target_seconds"]
    speculative_rate = totals["speculative_tokens"] / totals["speculative_seconds"]
    row = {"engine": ",".join(sorted(engines)), **totals, "tau": totals["committed"] / max(totals["steps"], 1),
           "target_tokens_per_s": target_rate, "speculative_tokens_per_s": speculative_rate,
           "speedup": speculative_rate / target_rate,
           "target_ms_per_token": 1000 * totals["target_seconds"] / max(totals["target_tokens"], 1)}
    if row_breakdowns:
        row["step_breakdown"] = row_breakdowns
    if profiled_steps:
        # Per speculative step (rollback only runs on steps that did not finish the decode); prefill per prompt.
        profile = timer.summary()["seconds"]
        row["profile"] = {"prompts": min(profile_prompts, len(prompts)), "steps": profiled_steps,
                          "seconds": profile,
                          "ms_per_step": {name.removeprefix("live_"): round(1000 * seconds / profiled_steps, 3)
                                          for name, seconds in profile.items() if name != "live_prefill"}}
    return row


# The replay's two drafting steps (DrafterProposer's fixed_shape): the gathered one and chunk_drafts.py's.
DRAFTING_STEPS = {"gathered": False, "fixed_shape": True}


def replay_drafting(drafter, adapter, prompts: list[list[int]], max_new_tokens: int, batch_size: int) -> dict:
    """The same replay (prompts answered before, so no generation) drafted by the gathered step and by the
    fixed-shape step (dflash/eval/chunk_drafts.py; on CUDA one graph a chunk, its capture included): seconds per
    phase, steps and tau of each."""
    by_step = {}
    for name, fixed_shape in DRAFTING_STEPS.items():
        timer = PhaseTimer(adapter.device)
        results = replay(drafter, adapter, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size,
                         timer=timer, fixed_shape=fixed_shape)
        metrics = acceptance_metrics([r.trace for r in results], drafter.config.block_size)
        by_step[name] = {"seconds": timer.summary()["seconds"], "tau": metrics["tau"],
                         "num_steps": metrics["num_steps"]}
    return by_step


PROPOSAL = "dflash: replay proposal"  # the profiler range around one drafting step


def replay_profile(drafter, adapter, prompts: list[list[int]], max_new_tokens: int, batch_size: int) -> dict:
    """The replay of `prompts` once more under torch.profiler for each drafting step (gathered and fixed-shape), each
    drafting step (proposal) in a range of its own: how many steps it took, and per step its wall time, its
    operators (the outermost aten calls, on every thread, as step_profile.phase_counts counts them; and every aten
    call, nested ones included, of the profiled thread), its kernel launches (a graph replay is one) and the device
    time of the kernels it launched, to tell host-bound steps from device-bound ones (generation and the target pass
    are left out). The profiler inflates host time; the wall time per proposal is measured the same way in both."""
    from torch.profiler import ProfilerActivity, profile, record_function

    def descendants(event) -> list:
        return [e for child in event.cpu_children for e in (child, *descendants(child))]

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if adapter.device.type == "cuda" else [])
    original = DrafterProposer.__call__
    by_step = {}
    for name, fixed_shape in DRAFTING_STEPS.items():
        walls: list[tuple[int, float]] = []  # (rows, seconds) per proposal

        def counted(self, batch_rows, starts, size, walls=walls):
            began = time.perf_counter()
            with record_function(PROPOSAL):
                drafts = original(self, batch_rows, starts, size)
            walls.append((len(batch_rows), time.perf_counter() - began))
            return drafts

        DrafterProposer.__call__ = counted
        try:
            with profile(activities=activities) as prof:
                replay(drafter, adapter, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size,
                       fixed_shape=fixed_shape)
        finally:
            DrafterProposer.__call__ = original
        events = prof.events()
        ranges = [e for e in events if e.name == PROPOSAL]
        inside = [e for r in ranges for e in descendants(r)]
        steps = max(len(walls), 1)
        counts = phase_counts(events).get(PROPOSAL, PhaseCount())
        by_step[name] = {
            "proposals": len(walls), "mean_rows": sum(r for r, _ in walls) / steps,
            "ms_per_proposal": 1000 * sum(w for _, w in walls) / steps,
            "operators_per_proposal": counts.operators / steps, "launches_per_proposal": counts.launches / steps,
            "aten_calls_per_proposal": sum(e.name.startswith("aten::") for e in inside) / steps,
            # A range's device time is that of the kernels its operators launched, each counted once.
            "device_ms_per_proposal": sum(r.device_time_total for r in ranges) / 1000 / steps,
            "top_operators": top_operators(inside, steps, by_device=adapter.device.type == "cuda")}
    return by_step


def top_operators(events, steps: int, by_device: bool) -> list[dict]:
    """The 15 operators of `events` with the most self time (device time when `by_device`), per proposal."""
    per_operator: dict[str, list[float]] = {}  # name -> [calls, self host ms, self device ms] per proposal
    for e in events:
        row = per_operator.setdefault(e.name, [0.0, 0.0, 0.0])
        row[0] += 1 / steps
        row[1] += e.self_cpu_time_total / 1000 / steps
        row[2] += e.self_device_time_total / 1000 / steps
    top = sorted(per_operator.items(), key=lambda item: -item[1][2 if by_device else 1])[:15]
    return [{"name": name, "calls": round(calls, 2), "self_host_ms": round(host, 4), "self_device_ms": round(device, 4)}
            for name, (calls, host, device) in top]


def main() -> None:
    args = parse_args()
    adapter = load_target("smollm2", device=args.device)
    prompts = [adapter.chat_ids(p.messages) for p in load_prompts(args.prompt_source)]
    if len(prompts) < max(args.replay_prompts, args.live_prompts, args.replay_profile):
        raise ValueError(f"{args.prompt_source} has {len(prompts)} prompts, fewer than requested")
    drafters = {"random": untrained_drafter(adapter, args.block_size)}
    if args.drafter:
        drafters["trained"] = load_drafter(args.drafter, dtype=adapter.dtype, device=str(adapter.device))
    names = (args.live_drafters or ("trained" if args.drafter else "random,oracle")).split(",")
    unknown = [n for n in names if n not in ("random", "oracle", "trained") or (n == "trained" and not args.drafter)]
    if unknown:
        raise ValueError(f"--live-drafters {unknown} unknown (random, oracle, trained; trained needs --drafter)")
    engines = args.live_engine.split(",")
    for engine in engines:
        resolve_engine(engine, adapter)  # an unknown or unsupported engine fails here, before any timing
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "device": torch.cuda.get_device_name(adapter.device) if adapter.device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "target": "SmolLM2-135M-Instruct", "dtype": str(adapter.dtype), "prompt_source": args.prompt_source,
        "max_new_tokens": args.max_new_tokens, "command": " ".join(sys.argv),
    }
    began = time.perf_counter()
    live_prompts = prompts[: args.live_prompts]
    report["live"] = {}
    breakdowns = ((0.0, "greedy"),) + (((args.profile_temperature, args.profile_draft_sampling),)
                                       if args.profile_temperature > 0 else ())
    for engine in engines:
        # Warm-up: kernels and allocator for every shape the loops use. The random drafter commits about one token
        # per step, so its last steps meet every shorter block size.
        live_row(drafters["random"], adapter, prompts[:1], min(args.max_new_tokens, 2 * args.block_size),
                 oracle=False, profile_prompts=1, engine=engine, breakdowns=breakdowns)
        for name in names:
            drafter = drafters["random" if name == "oracle" else name]
            key = f"{name}/{engine}"
            report["live"][key] = live_row(drafter, adapter, live_prompts, args.max_new_tokens, name == "oracle",
                                           args.profile_prompts, engine, breakdowns)
            # Partial results on stderr as they come, so a run cut short by a time limit still says something.
            print(f"[eval_speed] live {key}: {json.dumps(report['live'][key])}", file=sys.stderr, flush=True)
    replay_drafter = drafters.get("trained", drafters["random"])
    # Greedy replay: the settings of live decoding and of sampled drafts are unused.
    replay_options = dict(mode="replay", batch_size=args.replay_batch_size, measure_target=False, live_engine="auto",
                          draft_sampling="greedy", show_progress=False)
    evaluate(replay_drafter, adapter, {"warmup": prompts[:2]}, max_new_tokens=16, **replay_options)
    if adapter.device.type == "cuda":
        torch.cuda.synchronize(adapter.device)
    replay_began = time.perf_counter()
    summary = evaluate(replay_drafter, adapter, {args.prompt_source: prompts[: args.replay_prompts]},
                       max_new_tokens=args.max_new_tokens, **replay_options)
    if adapter.device.type == "cuda":
        torch.cuda.synchronize(adapter.device)
    report["replay"] = {"drafter": "trained" if "trained" in drafters else "random",
                        "prompts": args.replay_prompts, "batch_size": args.replay_batch_size,
                        "seconds": time.perf_counter() - replay_began,
                        "tau": summary["overall"]["tau"], "num_tokens": summary["overall"]["num_tokens"],
                        "num_steps": summary["overall"]["num_steps"],
                        "greedy_mismatches": summary["overall"]["greedy_mismatches"],
                        "timing": summary["timing"]["seconds"]}
    print(f"[eval_speed] replay: {json.dumps(report['replay'])}", file=sys.stderr, flush=True)
    if args.replay_drafting:
        report["replay_drafting"] = replay_drafting(replay_drafter, adapter, prompts[: args.replay_prompts],
                                                    args.max_new_tokens, args.replay_batch_size)
        print(f"[eval_speed] replay_drafting: {json.dumps(report['replay_drafting'])}", file=sys.stderr, flush=True)
    if args.replay_profile:
        report["replay_profile"] = replay_profile(replay_drafter, adapter, prompts[: args.replay_profile],
                                                  args.max_new_tokens, args.replay_batch_size)
        print(f"[eval_speed] replay_profile: {json.dumps(report['replay_profile'])}", file=sys.stderr, flush=True)
    report["bench_seconds"] = time.perf_counter() - began
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        temp = args.out + ".tmp"
        with open(temp, "w", encoding="utf-8") as f:
            f.write(text + "\n")
        os.replace(temp, args.out)


if __name__ == "__main__":
    main()

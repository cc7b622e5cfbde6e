"""Time full drafter training steps (forward, backward, optimizer) at the Qwen3.6-27B drafter shape; print JSON.

    python bench/train_step.py                  # one GPU: flex path and the SDPA reference, ~5 minutes
    python bench/train_step.py --tiny           # scaled-down shape on CPU, checks the script works
    torchrun --nproc_per_node 4 bench/train_step.py --only flex --zero-stage 3   # one path on 4 data-parallel ranks

Each path runs in its own subprocess (so peak memory is its own) through the real trainer: the DeepSpeed engine
(ZeRO-2 unless --zero-stage, bf16, one rank unless under torchrun), `train_step` of dflash.train.loop, random
weights and random target features.
  flex:      FlexAttention with the block-sparse BlockMask, chunked lm_head + CE (the trainer's CUDA default)
  sdpa_full: the straightforward reference: dense boolean mask through SDPA, the whole [positions, vocab] logits
             in one chunk (reported as not fitting if it runs out of memory)
Under torchrun, `--only PATH` runs that path on every rank (each on cuda:LOCAL_RANK, the same random batch on each,
data parallel through DeepSpeed with --zero-stage) and every rank prints its own RESULT line with its rank and the
world size (bench/multi_gpu.py's trainer scaling reads them).
TFLOP/s use the formula of dflash/train/step_metrics.py (6 x layer params x query positions + 4 x vocab x hidden x
query positions + 6 x (fc + context k/v params) x context positions); MFU divides by a bf16 8192^3 matmul measured
at the start of the same run. On CPU FlexAttention has no backward in torch, so --tiny runs the SDPA paths only.
peak_gib is the peak allocated over the timed steps, resident_gib what stays allocated between steps (weights,
fp32 master, Adam state, frozen embedding and head): their difference is what one step adds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.profile_table import profile_calls, write_table  # noqa: E402
from dflash.models.drafter_config import DrafterConfig  # noqa: E402

FULL = dict(hidden=5120, inter=17408, layers=5, heads=32, kv_heads=8, head_dim=128, window=2048, vocab=248320,
            seq=4096, anchors=512, block=16, taps=5)
# The SmolLM2-135M recipe's drafter (conf/experiment/smollm2.yaml): 5 full-attention layers of the target's shape.
SMOLLM2 = dict(hidden=576, inter=1536, layers=5, heads=9, kv_heads=3, head_dim=64, window=None, vocab=49152,
               seq=1024, anchors=512, block=16, taps=5)
TINY = dict(hidden=64, inter=128, layers=3, heads=4, kv_heads=2, head_dim=16, window=32, vocab=512, seq=256,
            anchors=16, block=4, taps=2)


def drafter_config(shape: dict) -> DrafterConfig:
    """The last layer is full attention, the others sliding (the Qwen3.6-27B drafter: 4 sliding + 1 full); all full
    when the shape has no window."""
    sliding = "sliding_attention" if shape["window"] else "full_attention"
    layer_types = [sliding] * (shape["layers"] - 1) + ["full_attention"]
    return DrafterConfig(
        hidden_size=shape["hidden"], intermediate_size=shape["inter"], num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"],
        vocab_size=shape["vocab"], num_target_layers=64, target_layer_ids=list(range(1, 1 + shape["taps"])),
        mask_token_id=shape["vocab"] - 1, block_size=shape["block"], layer_types=layer_types,
        sliding_window=shape["window"], rope_theta=1e7,
    )


def matmul_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    from dflash.train.step_metrics import measure_matmul_tflops

    return measure_matmul_tflops(device)


def run_path(path: str, shape: dict, device: torch.device, steps: int, warmup: int, loss_chunk: int,
             activation_checkpointing: bool = False, batch: int = 1, compile: bool = False,
             profile: str | None = None, zero_stage: int = 2) -> dict:
    """Build the engine and time `steps` training steps after `warmup` ones (this process only).

    batch: sequences per step. compile: torch.compile each drafter layer (train.compile). profile: write the
    torch.profiler table of two more steps (CUDA time per kernel) to this file.
    """
    from dflash.train.batches import prepare_micro_batch
    from dflash.train.engine import TrainEngine, init_distributed
    from dflash.config.schema import DeepSpeedSettings, TrainSettings
    from dflash.train.loop import train_step
    from dflash.train.step_metrics import step_flops

    rank, world_size, _ = init_distributed()
    config = drafter_config(shape)
    bf16 = device.type == "cuda"
    dtype = torch.bfloat16 if bf16 else torch.float32
    from dflash.models.drafter import DFlashDraftModel

    torch.manual_seed(0)  # the same random drafter in every path, so their first losses must agree
    with torch.device(device):
        drafter = DFlashDraftModel(config)
    if activation_checkpointing:
        from dflash.train.activation_checkpointing import apply_activation_checkpointing

        apply_activation_checkpointing(drafter)
    if compile:
        from dflash.train.compile_layers import compile_layers

        compile_layers(drafter)
    generator = torch.Generator().manual_seed(0)
    embed = (torch.randn(shape["vocab"], shape["hidden"], generator=generator) * 0.02).to(device, dtype)
    lm_head = (torch.randn(shape["vocab"], shape["hidden"], generator=generator) * 0.02).to(device, dtype)
    samples = [{
        "input_ids": torch.randint(0, shape["vocab"] - 1, (shape["seq"],), generator=generator),
        "loss_mask": torch.ones(shape["seq"], dtype=torch.long),
        "hidden": torch.randn(shape["seq"], shape["taps"] * shape["hidden"], generator=generator).to(dtype),
    } for _ in range(batch)]
    # As the trainer does on CUDA: the features in page-locked memory, copied to the GPU in every step.
    micro = prepare_micro_batch(samples, [(i, True) for i in range(batch)], epoch=0, seed=0,
                                num_anchors=shape["anchors"], block_size=shape["block"], gamma=7.0,
                                pin_memory=device.type == "cuda")
    queries = batch * shape["anchors"] * shape["block"]
    chunk = queries if path == "sdpa_full" else loss_chunk
    settings = TrainSettings(epochs=1, micro_batch_size=batch, grad_accum=1, lr=6e-4, weight_decay=0.0,
                             betas=(0.9, 0.95), warmup_ratio=0.04, min_lr_ratio=0.0, grad_clip=1.0,
                             num_anchors=shape["anchors"], gamma=7.0, seed=0, loss_chunk_size=chunk, log_every=1,
                             save_every=0, attention="flex" if path == "flex" else "sdpa")
    engine = TrainEngine(drafter, settings, DeepSpeedSettings(zero_stage=zero_stage), warmup + steps, world_size,
                         bf16=bf16)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    first_loss = None
    for _ in range(warmup):  # the first flex step compiles the kernels
        loss = train_step(engine, embed, lm_head, [micro], settings, 1, settings.attention)["loss"]
        first_loss = loss if first_loss is None else first_loss
    sync()
    resident = None
    if device.type == "cuda":
        # Between steps only what outlives a step is allocated: weights, master copy, Adam state, frozen head.
        resident = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        loss = train_step(engine, embed, lm_head, [micro], settings, 1, settings.attention)["loss"]
        sync()
        times.append(time.perf_counter() - started)
    step_s = sorted(times)[len(times) // 2]
    if profile:
        events = profile_calls(lambda: train_step(engine, embed, lm_head, [micro], settings, 1, settings.attention),
                               device, calls=2)
        write_table(profile, events, device, f"two more training steps of the {path} path after the timed ones")
    flops = step_flops(config, queries, batch * shape["seq"])
    result = {"path": path, "step_ms": round(step_s * 1e3, 2), "tflops": float(f"{flops / step_s / 1e12:.4g}"),
              "step_tflop": float(f"{flops / 1e12:.4g}"), "first_loss": round(first_loss, 5),
              "last_loss": round(loss, 5), "steps_timed": steps,
              "activation_checkpointing": activation_checkpointing, "batch": batch, "compile": compile,
              "zero_stage": zero_stage, "rank": rank, "world_size": world_size}
    if device.type == "cuda":
        result["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        result["resident_gib"] = round(resident / 2**30, 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="scaled-down shape on CPU (checks the script)")
    parser.add_argument("--shape", choices=("qwen36", "smollm2"), default="qwen36",
                        help="drafter shape on the GPU: the Qwen3.6-27B drafter or the SmolLM2 recipe's")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10, tiny 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3, tiny 1)")
    parser.add_argument("--paths", default=None,
                        help="comma list of flex, sdpa (dense mask, chunked CE), sdpa_full (default: flex,sdpa_full)")
    parser.add_argument("--loss-chunk", type=int, default=4096, help="lm_head + CE rows per chunk (not sdpa_full)")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute the drafter layers in backward (TFLOP/s still counts the model FLOPs once)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step (each of the shape's length)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: the shape's)")
    parser.add_argument("--anchors", type=int, default=None, help="anchors per sequence (default: the shape's)")
    parser.add_argument("--compile", action="store_true", help="torch.compile each drafter layer (train.compile)")
    parser.add_argument("--profile", default=None, help="write each path's torch.profiler table to PROFILE.PATH.txt")
    parser.add_argument("--zero-stage", type=int, choices=(1, 2, 3), default=2, help="DeepSpeed ZeRO stage")
    parser.add_argument("--only", default=None,
                        help="run this one path in this process (under torchrun: on every rank), print RESULT JSON")
    args = parser.parse_args()
    shape = dict(TINY if args.tiny else SMOLLM2 if args.shape == "smollm2" else FULL)
    shape.update({k: v for k, v in (("seq", args.seq), ("anchors", args.anchors)) if v is not None})
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if device.type == "cuda" and "LOCAL_RANK" in os.environ:  # a torchrun rank: its own GPU
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    steps = args.steps or (3 if args.tiny else 10)
    warmup = args.warmup or (1 if args.tiny else 3)
    if args.only:
        result = run_path(args.only, shape, device, steps, warmup, args.loss_chunk, args.activation_checkpointing,
                          batch=args.batch, compile=args.compile,
                          profile=f"{args.profile}.{args.only}.txt" if args.profile else None,
                          zero_stage=args.zero_stage)
        print("RESULT " + json.dumps(result), flush=True)
        return

    if not args.tiny and device.type != "cuda":
        raise SystemExit("the full shape needs a GPU; use --tiny on CPU")
    default_paths = "flex,sdpa_full" if device.type == "cuda" else "sdpa,sdpa_full"
    paths = (args.paths or default_paths).split(",")
    unknown = set(paths) - {"flex", "sdpa", "sdpa_full"}
    if unknown:
        raise SystemExit(f"unknown --paths {sorted(unknown)}; choose from flex, sdpa, sdpa_full")
    report = {"shape": shape, "batch": args.batch, "compile": args.compile, "loss_chunk": args.loss_chunk,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "matmul_bf16_tflops": None, "paths": []}
    matmul = matmul_tflops(device)
    if matmul is not None:
        report["matmul_bf16_tflops"] = round(matmul, 1)
    for path in paths:
        if path == "flex" and device.type != "cuda":
            report["paths"].append({"path": path, "skipped": "FlexAttention has no backward on CPU in torch"})
            continue
        command = [sys.executable, os.path.abspath(__file__), "--only", path, "--steps", str(steps),
                   "--warmup", str(warmup), "--loss-chunk", str(args.loss_chunk), "--shape", args.shape,
                   "--batch", str(args.batch), "--zero-stage", str(args.zero_stage), "--seq", str(shape["seq"]),
                   "--anchors", str(shape["anchors"])]
        for flag, on in (("--tiny", args.tiny), ("--activation-checkpointing", args.activation_checkpointing),
                         ("--compile", args.compile)):
            command += [flag] if on else []
        command += ["--profile", args.profile] if args.profile else []
        done = subprocess.run(command, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode == 0 and lines:
            result = json.loads(lines[-1][len("RESULT "):])
            if matmul is not None:
                result["mfu"] = round(result["tflops"] / matmul, 3)
        else:
            out_of_memory = "out of memory" in done.stderr.lower()
            result = {"path": path, "failed": "did not fit in GPU memory" if out_of_memory else "error",
                      "stderr_tail": done.stderr[-2000:]}
        report["paths"].append(result)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

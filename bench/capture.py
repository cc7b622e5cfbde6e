"""Capture throughput on the Qwen3.6-27B shape with random weights (method.md §7): tokens/s and TFLOP/s.

    python bench/capture.py                      # one CUDA GPU, bf16, the full 27B shape (~60 GB of weights)
    python bench/capture.py --tiny               # CPU smoke check of the same code on a tiny qwen3_5 model
    python bench/capture.py --conv torch fla --profile /tmp/capture.txt   # both GDN convs, a profile of each
    python bench/capture.py --conv fla --compile --capture-only   # decoder layers compiled (the warmup compiles)

Measured in one run, on the same batches of real-length-distributed sequences (log-normal, median ~1.1k tokens,
clipped to [64, 4096], grouped by length into right-padded batches of at most --batch-tokens tokens):
  * matmul:  a large bf16 matmul, the ceiling the layer stack's GEMMs can reach;
  * hf:      the base model with output_hidden_states=True (all 64 layers, every hidden state kept, no logits);
  * capture: TargetAdapter.capture (hooks on the 5 taps, stops after the deepest tap, no logits).
--conv measures each listed causal conv1d of the GDN layers in turn (torch: transformers' choice, its torch
reference unless causal-conv1d is installed; fla: flash-linear-attention's Triton kernel; auto: fla when it can).
--profile PATH writes a torch.profiler table (device time sorted) of one capture batch per conv (and of one packed run,
to PATH with ".packed" before the extension), and the run prints
the conv and gated-delta-rule kernels that batch ran.
--compile compiles every decoder layer (dflash.models.targets.compile_target) before the measurements and prints
how far the compiled features of the first batch are from the eager ones; that capture and the untimed warmup pass
pay the compilation of each call variant, and dynamo's graph and graph-break counts follow each conv's measurements.
--capture-only leaves out the hf forward (and the graphs its call variants would compile).
--layouts padded packed also measures packed capture (TargetAdapter.capture_packed: the same sequences laid end to
end in runs of at most --batch-tokens tokens, no padding; FlashAttention's varlen kernel and fla's kernels reading
cu_seqlens), after checking its features against the same sequences captured alone.
Tokens/s counts real tokens (padding excluded). Model FLOPs per token = 2 x (linear-layer parameters of the layers
that run) + causal attention scores and values of the full-attention layers; the GDN recurrence is left out
(small next to the projections), so TFLOP/s slightly understates the work done.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time

import numpy as np
import torch
import transformers
from torch._dynamo.utils import counters

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.profile_table import profile_calls, write_table  # noqa: E402
from dflash.extract.feature_checks import check_features  # noqa: E402
from dflash.extract.shard_rows import length_batches, packed_runs  # noqa: E402
from dflash.models.targets.compile_target import compile_target_layers  # noqa: E402
from dflash.models.targets.gdn_kernels import CONV_CHOICES, conv_choice  # noqa: E402
from dflash.models.targets.hybrid import HybridTargetAdapter  # noqa: E402
from dflash.models.targets.tiny import build_builtin_tokenizer  # noqa: E402
from dflash.train.step_profile import self_time_key  # noqa: E402

QWEN36_27B = dict(
    vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
    num_key_value_heads=4, head_dim=256, partial_rotary_factor=0.25, rope_theta=1e7, linear_num_key_heads=16,
    linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    full_attention_interval=4, max_position_embeddings=32768,
)
TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, max_position_embeddings=4096,
)


def build_model(shape: dict, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A random-weight Qwen3.5 text model, built on the meta device and materialised on `device`."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(**shape)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(config)
    model.to(dtype)  # on meta: free, and the 27B weights are then allocated once, in bf16
    model.to_empty(device=device)
    # to_empty leaves buffers uninitialised too: rebuild the modules that own some (RoPE inv_freq) and copy them.
    for name, module in model.named_modules():
        buffers = dict(module.named_buffers(recurse=False))
        if buffers:
            if not hasattr(module, "config"):
                raise RuntimeError(f"cannot rebuild the buffers {sorted(buffers)} of {name}")
            fresh = type(module)(module.config)
            for key, buffer in buffers.items():
                buffer.copy_(getattr(fresh, key))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.empty_like(param, dtype=torch.float32).uniform_(1, 16).log())
            elif name.endswith("dt_bias"):
                param.fill_(1.0)
            elif "norm" in name:
                # Qwen3.5 RMSNorms scale by (1 + weight) except the GDN output norm, which scales by weight.
                param.fill_(1.0 if "linear_attn.norm" in name else 0.0)
            elif param.dim() >= 2:
                param.normal_(0.0, 0.02)
            else:
                param.zero_()
    return model.eval().requires_grad_(False)


def draw_lengths(num_tokens: int, seed: int, low: int, high: int) -> list[int]:
    """Log-normal sequence lengths (median ~1.1k, like regenerated chat data) until num_tokens are drawn."""
    generator = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < num_tokens:
        x = math.exp(7.0 + 0.8 * float(torch.randn((), generator=generator)))
        lengths.append(int(min(max(x, low), high)))
    return lengths


def make_batches(lengths: list[int], batch_tokens: int, vocab: int, device: torch.device, seed: int) -> list:
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for group in length_batches(lengths, batch_tokens):
        width = max(lengths[j] for j in group)
        ids = torch.randint(4, vocab, (len(group), width), generator=generator)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for row, j in enumerate(group):
            mask[row, :lengths[j]] = 1
        batches.append((ids.to(device), mask.to(device), sum(lengths[j] for j in group)))
    return batches


def make_packed_runs(lengths: list[int], batch_tokens: int, vocab: int, device: torch.device, seed: int) -> list:
    """(ids [T] on device, lengths of its sequences, T) per packed run, the sequences in drawn order."""
    generator = torch.Generator().manual_seed(seed)
    runs = []
    for first, end in packed_runs(np.array(lengths), batch_tokens):
        run_lengths = lengths[first:end]
        ids = torch.randint(4, vocab, (sum(run_lengths),), generator=generator)
        runs.append((ids.to(device), run_lengths, sum(run_lengths)))
    return runs


def check_packed(adapter: HybridTargetAdapter, run: tuple, taps: list[int], samples: int = 3) -> float:
    """Relative difference between a packed run's features and its first `samples` sequences captured alone."""
    ids, lengths, _ = run
    packed = adapter.capture_packed(ids, lengths, taps)
    count = min(samples, len(lengths))
    check_features(packed[None, :sum(lengths[:count])], [sum(lengths[:count])], ["packed run"], taps)
    alone, start = [], 0
    for length in lengths[:count]:
        alone.append(adapter.capture(ids[start:start + length][None], None, taps)[0].float().cpu())
        start += length
    reference = torch.cat(alone)
    return float((packed[:start].float().cpu() - reference).norm() / reference.norm())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int, repeats: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync(device)
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12


def flops_per_token(model: torch.nn.Module, layers_run: int, mean_context: float) -> float:
    """2 x linear parameters of the first `layers_run` decoder layers + causal attention of their full layers."""
    config = model.config
    layers = model.model.layers[:layers_run]
    linear = sum(m.weight.numel() for layer in layers for m in layer.modules() if isinstance(m, torch.nn.Linear))
    full = sum(1 for i in range(layers_run) if config.layer_types[i] == "full_attention")
    q_dim = config.num_attention_heads * config.head_dim
    # Scores and weighted values: 2 matmuls x 2 FLOPs x (average causal context) x q_dim per token.
    return 2.0 * linear + full * 4.0 * mean_context * q_dim


def timed(run, batches: list, device: torch.device, warmup: bool) -> tuple[float, int]:
    """Seconds and real tokens of one pass over `batches`, after an untimed pass when `warmup`: every new batch
    shape costs seconds of Triton autotuning the first time, which a throughput figure must not include."""
    for ids, mask, _ in batches if warmup else []:
        run(ids, mask)
    sync(device)
    start, tokens = time.perf_counter(), 0
    for ids, mask, real in batches:
        run(ids, mask)
        tokens += real
    sync(device)
    return time.perf_counter() - start, tokens


# Kernel (CUDA) or op (CPU) names of the causal conv1d and of the chunked gated delta rule, in the profile.
GDN_KERNEL_PATTERN = re.compile(r"conv|delta|kkt|tril|inverse|l2norm|w_u|cumsum|chunk", re.IGNORECASE)


def profile_call(call, description: str, device: torch.device, path: str) -> None:
    """Profile `call()`, write its table (device time sorted; CPU time on the CPU) atomically to `path` and print
    the conv / gated-delta-rule kernels that ran."""
    events = profile_calls(call, device)
    write_table(path, events, device, description)
    key = self_time_key(device)
    total = sum(getattr(e, key) for e in events) or 1.0
    gdn = sorted((e for e in events if GDN_KERNEL_PATTERN.search(e.key) and getattr(e, key) > 0),
                 key=lambda e: -getattr(e, key))
    print(f"    profile written to {path}; conv / gated-delta-rule kernels that ran:")
    for event in gdn[:12]:
        print(f"      {getattr(event, key) / 1e3:9.1f} ms {100 * getattr(event, key) / total:5.1f}%  "
              f"x{event.count:<5} {event.key[:110]}")


def output_path(path: str, conv: str, batch_tokens: int, several_convs: bool, several_sizes: bool) -> str:
    """`path` with ".<conv>" and ".<batch_tokens>" inserted before the extension when a run makes several."""
    stem, ext = os.path.splitext(path)
    return stem + (f".{conv}" if several_convs else "") + (f".{batch_tokens}" if several_sizes else "") + ext


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny qwen3_5 on CPU, float32 (a smoke check)")
    parser.add_argument("--taps", type=int, nargs="+", default=None, help="tap ids (default 1 16 31 46 61)")
    parser.add_argument("--batch-tokens", type=int, nargs="+", default=[32768],
                        help="padded tokens per batch (several values: one measurement each)")
    parser.add_argument("--tokens", type=int, default=200_000, help="real tokens per measured pass")
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed pass over the batches")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--conv", nargs="+", choices=CONV_CHOICES, default=["auto"],
                        help="GDN causal conv1d(s) to measure, one after the other (default auto)")
    parser.add_argument("--profile", metavar="PATH", default=None,
                        help="write a torch.profiler table of one capture batch (per conv and batch size) here")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile each decoder layer first (without --no-warmup, compile time is untimed)")
    parser.add_argument("--layouts", nargs="+", choices=["padded", "packed"], default=["padded"],
                        help="capture layouts to measure: right-padded batches and/or packed runs (default padded)")
    parser.add_argument("--capture-only", action="store_true",
                        help="measure capture alone, not the hf output_hidden_states forward (fewer graphs to compile)")
    args = parser.parse_args()

    if args.tiny:
        device, dtype, shape = torch.device("cpu"), torch.float32, TINY
        taps = args.taps or [1, 3, 6]
        args.tokens, args.max_length = min(args.tokens, 4000), 512
        args.batch_tokens = [min(b, 2048) for b in args.batch_tokens]
        matmul_n, repeats = 512, 5
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --tiny for the CPU check")
        device, dtype, shape = torch.device("cuda"), torch.bfloat16, QWEN36_27B
        taps = args.taps or [1, 16, 31, 46, 61]
        matmul_n, repeats = 8192, 50
    torch.manual_seed(args.seed)
    model = build_model(shape, device, dtype)
    adapter = HybridTargetAdapter(model, build_builtin_tokenizer())
    lengths = draw_lengths(args.tokens, args.seed, 64 if not args.tiny else 8, args.max_length)
    mean_context = sum(n * (n + 1) / 2 for n in lengths) / sum(lengths)
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, dtype {dtype}, "
          f"torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"{len(lengths)} sequences, {sum(lengths)} tokens, mean length {sum(lengths) / len(lengths):.0f}, "
          f"taps {taps}")

    peak = matmul_tflops(device, dtype, matmul_n, repeats)
    flops_hf = flops_per_token(model, adapter.num_layers, mean_context)
    flops_capture = flops_per_token(model, max(taps) + 1, mean_context)
    print(f"matmul ceiling: {peak:.3g} TFLOP/s = {peak * 1e12 / flops_hf:,.0f} tok/s for a full forward")

    def hf(ids: torch.Tensor, mask: torch.Tensor) -> None:
        with torch.no_grad(), conv_choice(adapter.gdn_conv):  # a direct call of the model: its conv set here
            model.model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)

    def capture(ids: torch.Tensor, mask: torch.Tensor) -> None:
        adapter.capture(ids, mask, taps)

    def capture_packed(ids: torch.Tensor, run_lengths: list[int]) -> None:
        adapter.capture_packed(ids, run_lengths, taps)

    for batch_tokens in args.batch_tokens:
        batches = make_batches(lengths, batch_tokens, shape["vocab_size"], device, args.seed)
        padded = sum(ids.numel() for ids, _, _ in batches)
        print(f"batch_tokens {batch_tokens}: {len(batches)} batches, {100 * (1 - sum(lengths) / padded):.1f}% padding")
        ids, mask, _ = batches[0]
        reference = None
        for conv in args.conv:
            adapter.set_gdn_conv(conv)  # prints the conv and chunk kernels now in use
            # Random weights through 64 layers must still give finite, varying states, or the timing means nothing.
            features = adapter.capture(ids, mask, taps)
            check_features(features, mask.sum(dim=1).tolist(), [str(i) for i in range(len(ids))], taps)
            # Real tokens only, kept on the host so that the peak memory figures below do not include them.
            features = features[mask.bool()].cpu().float()
            if args.compile and compile_target_layers(adapter):  # once: then the eager features above check it
                compiled = adapter.capture(ids, mask, taps)[mask.bool()].cpu().float()
                error = (compiled - features).norm() / features.norm()
                print(f"    compiled the decoder layers: features vs eager, relative difference {float(error):.2e}")
                features = compiled
            if reference is None:
                reference = (conv, features)
            else:
                error = (features - reference[1]).norm() / reference[1].norm()
                print(f"    features vs conv {reference[0]}: relative difference {float(error):.2e}")
            measured = [("hf output_hidden_states", hf, flops_hf, batches)] if not args.capture_only else []
            if "padded" in args.layouts:
                measured.append(("capture", capture, flops_capture, batches))
            if "packed" in args.layouts:
                runs = make_packed_runs(lengths, batch_tokens, shape["vocab_size"], device, args.seed)
                print(f"    packed: {len(runs)} runs of up to {batch_tokens} tokens; features vs the same sequences "
                      f"captured alone: relative difference {check_packed(adapter, runs[0], taps):.2e}")
                measured.append(("capture packed", capture_packed, flops_capture, runs))
            for name, run, flops, inputs in measured:
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                seconds, tokens = timed(run, inputs, device, not args.no_warmup)
                rate = tokens / seconds
                memory = (f", peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB"
                          if device.type == "cuda" else "")
                label = f"[conv {conv}, compile {'on' if args.compile else 'off'}]"
                print(f"{name:>24} {label}: {rate:,.0f} tok/s, {rate * flops / 1e12:.3g} TFLOP/s "
                      f"({100 * rate * flops / 1e12 / peak:.0f}% of the matmul){memory}")
            if args.compile:
                print(f"    dynamo so far: {counters['stats']['unique_graphs']} graphs, "
                      f"{sum(counters['graph_break'].values())} graph breaks")
            if args.profile:
                path = output_path(args.profile, conv, batch_tokens, len(args.conv) > 1, len(args.batch_tokens) > 1)
                if "padded" in args.layouts:
                    profile_call(lambda: capture(ids, mask), f"one capture batch {tuple(ids.shape)}, "
                                 f"{int(mask.sum())} real tokens", device, path)
                if "packed" in args.layouts:
                    run_ids, run_lengths, _ = runs[0]
                    stem, ext = os.path.splitext(path)
                    profile_call(lambda: capture_packed(run_ids, run_lengths), f"one packed run of "
                                 f"{len(run_lengths)} sequences, {len(run_ids)} tokens", device, stem + ".packed" + ext)


if __name__ == "__main__":
    main()

"""One decode step's attention of the regeneration engine, by kernel: what reading only each row's own prefix of the
KV cache would save over today's masked SDPA.

    python bench/decode_attention.py --out bench/decode_attention.json          # one GPU: every variant
    python bench/decode_attention.py --device cpu --rows 8 --length 256         # smoke test (the variants CPU has)

Shape: SmolLM2-135M's attention (9 query heads, 3 KV heads, head dim 64) over a static cache of `--length` columns
for `--rows` rows, one new token per row, as dflash/inference/static_decode.py decodes. Row r attends over its first
lengths[r] columns; lengths are drawn uniformly from [--min-length, --length] (rows at every stage of their answer,
as refill keeps them), or all `--length` with --full. Variants (each skipped with its error where this torch or device
lacks it):
  * sdpa_mask:       today's engine: the 3 query heads of a KV group folded into query rows, cache [R, kv, L, D],
                     an additive mask [R, 1, 1, L]; SDPA reads every column up to the step's span for every row;
  * sdpa_mask_blhd:  the same over a cache laid out [R, L, kv, D] (seen through a transposed view), the layout the
                     varlen kernels need;
  * flash_varlen:    FlashAttention-2 (aten._flash_attention_forward) over the [R, L, kv, D] cache flattened to
                     [R * L, kv, D], each row a sequence of L keys of which seqused_k = lengths[r] are read; queries
                     unfolded ([R, 9, D], GQA in the kernel) and folded ([R * 3, 3, D]);
  * memeff_varlen:   the mem-efficient kernel (aten._efficient_attention_forward) on the same packing, with
                     seqlen_k = lengths;
  * flex_BLOCK:      the engine's flex attention (dflash/models/targets/row_attention.py: compiled flex_attention
                     over the [R, kv, L, D] cache, a BlockMask of the row's whole blocks unmasked and the one it cuts
                     masked);
                     flex_BLOCK_with_update also rewrites the block lists in each call, as each step does once.
Each variant's output is compared with a float32 reference (max abs error). Time per call: CUDA events around
--iters calls after --warmup, median of --repeats; `gbps` divides the bytes of keys and values the rows need
(sum of lengths * kv * D * 2 tensors * element size) by that time, so a kernel that reads padding scores lower.
Prints a table, writes JSON to --out.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dflash.models.targets.row_attention import RowPrefixAttention  # noqa: E402
from dflash.run_files import write_json  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--length", type=int, default=1280, help="cache columns (a multiple of 128)")
    parser.add_argument("--min-length", type=int, default=64)
    parser.add_argument("--full", action="store_true", help="every row attends over all --length columns")
    parser.add_argument("--blocks", type=int, nargs="*", default=[128, 64], help="flex BlockMask block sizes")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    return parser.parse_args()


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """float32 attention: q [R, kv, g, D], cache [R, kv, L, D] -> [R, kv, g, D], row r over columns < lengths[r]."""
    logits = q.float() @ keys.float().transpose(-1, -2) / math.sqrt(q.shape[-1])
    visible = torch.arange(keys.shape[2], device=q.device) < lengths[:, None]
    logits = logits.masked_fill(~visible[:, None, None, :], float("-inf"))
    return torch.softmax(logits, dim=-1) @ values.float()


def variants(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
             blocks: list[int]) -> dict[str, Callable[[], torch.Tensor]]:
    """name -> a call returning [R, kv, g, D] (the folded query layout)."""
    rows, kv, groups, dim = q.shape
    length = keys.shape[2]
    device = q.device
    span = min(length, -(-int(lengths.max()) // 128) * 128)
    scale = 1 / math.sqrt(dim)
    mask = torch.zeros(rows, length, device=device, dtype=q.dtype).masked_fill_(
        torch.arange(length, device=device) >= lengths[:, None], float("-inf"))[:, None, None, :span]
    # The [R, L, kv, D] layout the varlen kernels read: one sequence of L keys per row.
    keys_bl = keys.transpose(1, 2).contiguous()
    values_bl = values.transpose(1, 2).contiguous()
    q_unfolded = q.reshape(rows, kv * groups, dim)                   # [R, 9, D]: one query token per row
    q_folded = q.transpose(1, 2).reshape(rows * groups, kv, dim)     # [R * g, kv, D]: g query tokens per row
    lengths32 = lengths.to(torch.int32)
    cu_k = (torch.arange(rows + 1, device=device, dtype=torch.int32) * length)
    cu_q1 = torch.arange(rows + 1, device=device, dtype=torch.int32)
    cu_qg = cu_q1 * groups

    def sdpa_mask():
        return F.scaled_dot_product_attention(q, keys[:, :, :span], values[:, :, :span], attn_mask=mask)

    def sdpa_mask_blhd():
        return F.scaled_dot_product_attention(q, keys_bl[:, :span].transpose(1, 2), values_bl[:, :span].transpose(1, 2),
                                              attn_mask=mask)

    def flash(folded: bool):
        def call():
            query, cu_q, max_q = (q_folded, cu_qg, groups) if folded else (q_unfolded, cu_q1, 1)
            out = torch.ops.aten._flash_attention_forward(
                query, keys_bl.view(rows * length, kv, dim), values_bl.view(rows * length, kv, dim), cu_q, cu_k,
                max_q, length, 0.0, False, False, scale=scale, seqused_k=lengths32)[0]
            if folded:
                return out.view(rows, groups, kv, dim).transpose(1, 2)
            return out.view(rows, kv, groups, dim)
        return call

    def memeff():
        out = torch.ops.aten._efficient_attention_forward(
            q_folded[None], keys_bl.view(1, rows * length, kv, dim), values_bl.view(1, rows * length, kv, dim), None,
            cu_qg, cu_k, groups, length, 0.0, 0, False, scale=scale, seqlen_k=lengths32)[0]
        return out.view(rows, groups, kv, dim).transpose(1, 2)

    calls = {"sdpa_mask": sdpa_mask, "sdpa_mask_blhd": sdpa_mask_blhd, "flash_varlen_unfolded": flash(False),
             "flash_varlen_folded": flash(True), "memeff_varlen": memeff}
    for block in blocks:
        calls[f"flex_{block}"] = flex_call(q, keys, values, lengths, block)
        calls[f"flex_{block}_with_update"] = flex_call(q, keys, values, lengths, block, with_update=True)
    return calls


def flex_call(q, keys, values, lengths, block: int, with_update: bool = False) -> Callable[[], torch.Tensor]:
    """The regeneration engine's flex attention (dflash/models/targets/row_attention.py) for rows whose keys are
    columns 0..lengths - 1; with_update: each call also rewrites the block lists (once per step in the engine,
    shared by all its layers)."""
    rows, kv, groups, _ = q.shape
    attention = RowPrefixAttention(rows, kv, groups, keys.shape[2], q.device, block=block)
    column = lengths - 1
    attention.update(column)
    scale = 1 / math.sqrt(q.shape[-1])

    def call():
        if with_update:
            attention.update(column)
        return attention(q, keys, values, scale)
    return call


def measure(call: Callable[[], torch.Tensor], device: str, warmup: int, iters: int, repeats: int) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        call()
    cuda = torch.device(device).type == "cuda"
    samples = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                call()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1000 / iters)
        else:
            begin = time.perf_counter()
            for _ in range(iters):
                call()
            samples.append((time.perf_counter() - begin) / iters)
    return statistics.median(samples)


def main() -> None:
    args = parse_args()
    torch.set_grad_enabled(False)
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    rows, length, device = args.rows, args.length, args.device
    if length % 128 or any(length % b for b in args.blocks):
        raise SystemExit(f"--length {length} must be a multiple of 128 and of every --blocks size")
    groups = HEADS // KV_HEADS
    q = torch.randn(rows, KV_HEADS, groups, HEAD_DIM, device=device, dtype=dtype)
    keys = torch.randn(rows, KV_HEADS, length, HEAD_DIM, device=device, dtype=dtype)
    values = torch.randn(rows, KV_HEADS, length, HEAD_DIM, device=device, dtype=dtype)
    if args.full:
        lengths = torch.full((rows,), length, device=device)
    else:
        lengths = torch.randint(args.min_length, length + 1, (rows,), device=device)
    want = reference(q, keys, values, lengths)
    needed = int(lengths.sum()) * KV_HEADS * HEAD_DIM * 2 * keys.element_size()
    print(f"[bench] {rows} rows, cache {length} columns, lengths mean {lengths.float().mean():.0f} "
          f"(max {int(lengths.max())}), {dtype}, {device}; K+V the rows need: {needed / 1e9:.3f} GB", flush=True)
    results = {}
    for name, call in variants(q, keys, values, lengths, args.blocks).items():
        try:
            got = call()
            error = float((got.float() - want).abs().max())
            seconds = measure(call, device, args.warmup, args.iters, args.repeats)
            results[name] = {"ms": seconds * 1e3, "gbps": needed / seconds / 1e9, "max_abs_error": error}
        except Exception as err:  # noqa: BLE001 - a variant this torch or device lacks is reported, not fatal
            results[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
        row = results[name]
        line = (f"{row['ms']:8.3f} ms  {row['gbps']:7.0f} GB/s  max abs error {row['max_abs_error']:.2e}"
                if "ms" in row else row["error"])
        print(f"  {name:24s} {line}", flush=True)
    base = results.get("sdpa_mask", {}).get("ms")
    if base:
        for row in results.values():
            if "ms" in row:
                row["speedup_vs_sdpa_mask"] = base / row["ms"]
    report = {"rows": rows, "length": length, "mean_length": float(lengths.float().mean()), "dtype": args.dtype,
              "device": torch.cuda.get_device_name() if torch.device(device).type == "cuda" else device,
              "torch": torch.__version__, "kv_bytes_needed": needed, "variants": results}
    if args.out:
        write_json(args.out, report)


if __name__ == "__main__":
    main()

"""What a training step reports beyond the loss: expected acceptance length and model FLOPs (for TFLOP/s, MFU).

FLOP formula (the 6 x parameters x tokens count of other trainers' reports, so numbers compare), per optimizer step:
    6 x (drafter decoder-layer parameters) x (query positions)          trainable layers, forward + backward
  + 4 x vocab x hidden x (query positions)                              frozen lm_head: forward + input gradient
  + 6 x (fc parameters + per-layer k_proj/v_proj parameters) x (context positions)   context feature and its K/V
Query positions = sequences x anchors x block_size (padding anchors included: the decoder layers compute them; the
lm_head runs only on the rows with a loss weight, so its term overstates its work by a few percent); context
positions = sequences x padded length. Attention scores (q.k and p.v) are not counted, as in those reports.
"""

from __future__ import annotations

import time

import torch

from dflash.models.drafter_config import DrafterConfig


def expected_acceptance_length(position_accuracy: list[float]) -> float:
    """1 + sum_k prod_{j<=k} acc_j over block positions 1..B-1: the tau a drafter with these accuracies would
    reach if its errors were independent across positions (the bonus token gives the 1)."""
    total, running = 1.0, 1.0
    for accuracy in position_accuracy:
        running *= accuracy
        total += running
    return total


def layer_parameters(config: DrafterConfig) -> int:
    """Parameters of the decoder layers (attention, MLP, norms)."""
    hidden, heads, kv_heads, head_dim = (config.hidden_size, config.num_attention_heads,
                                         config.num_key_value_heads, config.head_dim)
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2 + 2 * head_dim
    mlp = 3 * hidden * config.intermediate_size
    return config.num_hidden_layers * (attention + mlp + 2 * hidden)


def context_parameters(config: DrafterConfig) -> int:
    """Parameters applied to every context position: fc and each layer's k_proj / v_proj."""
    kv = 2 * config.hidden_size * config.num_key_value_heads * config.head_dim
    return config.num_taps * config.hidden_size * config.hidden_size + config.num_hidden_layers * kv


def step_flops(config: DrafterConfig, query_positions: int, context_positions: int) -> float:
    """Model FLOPs of one forward + backward by the formula of the module docstring."""
    return (6.0 * layer_parameters(config) * query_positions
            + 4.0 * config.vocab_size * config.hidden_size * query_positions
            + 6.0 * context_parameters(config) * context_positions)


def measure_matmul_tflops(device: torch.device, size: int = 8192, repeats: int = 20) -> float:
    """bf16 [size x size] @ [size x size] TFLOP/s on `device` (CUDA): the peak MFU is measured against."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize(device)
    return 2.0 * size**3 * repeats / (time.perf_counter() - started) / 1e12

"""torch.compile of the drafter's decoder layers, applied from outside the model (train.compile).

A drafter as narrow as the SmolLM2 recipe's (hidden 576) is launch-bound: one training step issues thousands of
small kernels (norms, RoPE, SwiGLU, residual adds) and reaches a few percent of the GPU's matmul rate. Compiling
each layer fuses those into few kernels. `nn.Module.compile` compiles the instance's call in place, so parameter
names, checkpoints and the DeepSpeed wrapping are unchanged; shapes are marked dynamic because every micro-batch
has its own padded length. The first steps pay the compilation.
"""

from __future__ import annotations

import torch._inductor.config as inductor_config
from torch import nn


def compile_layers(drafter: nn.Module) -> nn.Module:
    # torch 2.11's inductor asserted inside its memory-coalescing tiling analysis while generating the Triton code
    # of these dynamic-shape layers on an H200 (an AssertionError in tiling_utils.get_pw_red_splits); the analysis
    # only chooses among tilings, so turning it off changes speed at most, never results.
    if hasattr(inductor_config, "triton") and hasattr(inductor_config.triton, "coalesce_tiling_analysis"):
        inductor_config.triton.coalesce_tiling_analysis = False
    # Its "mix-order" reduction (the q/k-norm weight gradient summed in the same kernel as the row reduction) sized
    # its workspace from one length and viewed it with another in a later micro-batch on an H200 (torch 2.11:
    # "shape '[1731, 64]' is invalid for input of size 1536", 64 anchors x 64 sequences); pytorch issue 186426
    # reports the same family of dynamic-shape failures. Plain split reductions compute the same sums.
    if hasattr(inductor_config, "triton") and hasattr(inductor_config.triton, "mix_order_reduction"):
        inductor_config.triton.mix_order_reduction = False
    for layer in drafter.layers:
        if getattr(layer, "_dflash_compiled", False):
            continue
        layer.compile(dynamic=True)
        layer._dflash_compiled = True
    return drafter

"""torch.compile of the drafter's decoder layers, applied from outside the model (train.compile).

A drafter as narrow as the SmolLM2 recipe's (hidden 576) is launch-bound: one training step issues thousands of
small kernels (norms, RoPE, SwiGLU, residual adds) and reaches a few percent of the GPU's matmul rate. Compiling
each layer fuses those into few kernels. `nn.Module.compile` compiles the instance's call in place, so parameter
names, checkpoints and the DeepSpeed wrapping are unchanged; shapes are marked dynamic because every micro-batch
has its own padded length. The first steps pay the compilation.
"""

from __future__ import annotations

from torch import nn

from dflash.inductor_settings import compile_once, configure_inductor


def compile_layers(drafter: nn.Module) -> nn.Module:
    configure_inductor()
    for layer in drafter.layers:
        compile_once(layer, lambda module: module.compile(dynamic=True))
    return drafter

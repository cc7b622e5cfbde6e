"""torch.compile of a target's decoder layers for capture, applied from outside the model.

On an H200 a bf16 capture of the Qwen3.6-27B shape spends about a quarter of its device time in small eager
kernels between the matmuls (RMSNorms, gates, SiLU, casts, copies); compiling each decoder layer fuses them.
Each layer's `forward` is compiled on the instance, not its `__call__` (what `nn.Module.compile` compiles): the
forward hooks that capture installs afresh on every call then stay eager, outside the graph (the hook of the
deepest tap raises to stop the forward), and all layers of one kind share one graph instead of one graph per
tapped layer, which keeps the count well under dynamo's per-code recompile limit for 64 layers. Parameter names
and module structure are unchanged. Shapes are dynamic: every capture batch has its own padded length. The GDN
kernels are left as they are: flash-linear-attention marks its chunked gated delta rule torch.compiler.disable, so
dynamo breaks the graph around it; the conv router's context-variable read breaks it too. The first batch of each
new call variant pays the compilation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from dflash.inductor_settings import COMPILED_MARK, compile_once, configure_inductor, raise_recompile_limit
from dflash.models.targets.base import TargetAdapter

# Graphs one layer code may need: every decoder layer of a family runs the same `forward` code, compiled once per
# call variant (layer kind x padding mask absent / 2-D / 4-D x a batch of one or several, as dynamic shapes still
# specialise a size of 1 x the kwargs of a capture or of an output_hidden_states forward); past dynamo's default
# of 8 per code it runs the remaining variants eagerly, with one warning.
RECOMPILE_LIMIT = 64


def compile_target_layers(adapter: TargetAdapter) -> int:
    """Compile the forward of every decoder layer of `adapter` in place (dynamic shapes) and return how many
    layers this call compiled: 0 when all were compiled already."""
    configure_inductor()
    raise_recompile_limit(RECOMPILE_LIMIT)

    def compile_forward(layer: torch.nn.Module) -> None:
        layer.forward = torch.compile(layer.forward, dynamic=True)

    return sum(compile_once(layer, compile_forward) for layer in adapter.decoder_layers())


@contextlib.contextmanager
def target_layers_compiled(adapter: TargetAdapter, enabled: bool = True) -> Iterator[None]:
    """capture.compile: the decoder layers compiled while the block runs, as they were before it after it.

    The same target later serves the eval stage in this process (the static-cache engine captures CUDA graphs of
    the eager layers), so each layer this block compiles gets back the forward it had: the class's, or the instance
    wrapper that accelerate's hooks put on every layer of a target placed over several GPUs (it moves the inputs to
    the layer's GPU). Layers compiled before the block stay compiled; a compilation that fails partway leaves none
    of this block's compiled.
    """
    if not enabled:
        yield
        return
    before = {id(layer): vars(layer).get("forward") for layer in adapter.decoder_layers()
              if not getattr(layer, COMPILED_MARK, False)}
    try:
        compile_target_layers(adapter)
        yield
    finally:
        for layer in adapter.decoder_layers():
            if id(layer) not in before or not getattr(layer, COMPILED_MARK, False):
                continue
            previous = before[id(layer)]
            if previous is None:
                del layer.forward  # the class's forward shows through again
            else:
                layer.forward = previous
            delattr(layer, COMPILED_MARK)

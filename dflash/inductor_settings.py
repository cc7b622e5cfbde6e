"""Inductor settings for dflash's compiled layers with dynamic shapes: the drafter's layers in training
(dflash/train/compile_layers.py) and the target's layers in capture (dflash/models/targets/compile_target.py).

Two of inductor's code-generation strategies failed for such layers on an H200 (torch 2.11). Both only choose
between ways of generating the same computation, so turning them off changes speed at most, never results:
- the memory-coalescing tiling analysis asserted while generating Triton code (an AssertionError in
  tiling_utils.get_pw_red_splits);
- the "mix-order" reduction (a norm's weight gradient summed in the kernel of the row reduction) sized its
  workspace from one length and viewed it with another in a later micro-batch ("shape '[1731, 64]' is invalid for
  input of size 1536", 64 anchors x 64 sequences); pytorch issue 186426 reports the same family of failures.

Duck sizing is turned off too: by default dynamo gives sizes that are equal at the first trace one symbol. With it
on, the recipe's 64 anchor slots shared one with the batch (64 sequences until session 38) and the head dim (64, a
constant), so the
slots are fixed at 64 and the first micro-batch with 32 slots recompiles both layer graphs (measured on one H200:
27 s, at step 74); a first batch padded to 1,024 tokens ties its length to the 1,024 queries the same way. The
setting stays off for the rest of the process (dynamo reads it at each trace), also after a target's compiled layers
are given back; the other compiled code here compiles no more graphs with it off.

Float specialisation is turned on: by default dynamo passes a Python float that reaches a compiled graph (an
RMSNorm's epsilon, an attention scale) as a graph input, a 0-d tensor made on the host at every call and read back
inside the graph. That is four to five operators per float per call, outside any kernel: on one H100 the GPU
default's profile showed 140 of each per colocated target forward and 40 per drafter forward (session 34), host
time in a step the host bounds. Specialised, each such float is a constant of the graph, as these are for a whole
run (a different value would compile another graph, as a different integer constant does).
"""

from __future__ import annotations

from collections.abc import Callable

import torch._dynamo.config as dynamo_config
import torch._inductor.config as inductor_config
import torch.fx.experimental._config as fx_config
from torch import nn

# Set on a layer once it is compiled, so that no layer is ever compiled twice.
COMPILED_MARK = "_dflash_compiled"
TURNED_OFF_TRITON_OPTIONS = ("coalesce_tiling_analysis", "mix_order_reduction")


def configure_inductor() -> None:
    """Turn off the code-generation strategies above (those this torch release has) and duck sizing; turn on float
    specialisation."""
    triton_options = getattr(inductor_config, "triton", None)
    for option in TURNED_OFF_TRITON_OPTIONS:
        if hasattr(triton_options, option):
            setattr(triton_options, option, False)
    fx_config.use_duck_shape = False
    if hasattr(dynamo_config, "specialize_float"):  # older releases specialise floats already
        dynamo_config.specialize_float = True


def raise_recompile_limit(limit: int) -> None:
    """Let dynamo keep at least `limit` compiled graphs per code object (its default is 8); never lowers it."""
    # Older torch releases call the limit cache_size_limit.
    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo_config, name, max(getattr(dynamo_config, name), limit))


def compile_once(layer: nn.Module, compile_layer: Callable[[nn.Module], None]) -> bool:
    """compile_layer(layer) unless the layer is compiled already (then False); marks it compiled."""
    if getattr(layer, COMPILED_MARK, False):
        return False
    compile_layer(layer)
    setattr(layer, COMPILED_MARK, True)
    return True

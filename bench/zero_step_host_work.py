"""The host's work in a ZeRO step of the SmolLM2 recipe's drafter: DeepSpeed's defaults against dflash's (the
lighter gradient checks of dflash/train/engine.py, lighten_gradient_checks, the weights left where they point,
keep_weight_views, one rank's gradients left unreduced, skip_one_rank_reduction, and
deepspeed.contiguous_gradients off); print JSON.

    python bench/zero_step_host_work.py                  # bf16, ZeRO-2, the recipe's 5-layer drafter (58 tensors)
    python bench/zero_step_host_work.py --steps 20 --zero-stage 1

For each variant and phase (engine.backward of a loss that reaches every parameter, engine.step): the operators
Python dispatched (step_profile.phase_counts: an aten call inside another counts with its caller, autograd's
threads included), and the phase's wall
milliseconds (mean of --steps after two warm-up steps; on a GPU the host's time to issue it, which a host-bound
training step waits for, the device synchronised between phases). On a CPU the operator counts are those of a GPU
run, the milliseconds are not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dflash.config.schema import DeepSpeedSettings, TrainSettings  # noqa: E402
from dflash.models.drafter import DFlashDraftModel  # noqa: E402
from dflash.models.drafter_config import DrafterConfig  # noqa: E402
from dflash.train.engine import TrainEngine, init_distributed  # noqa: E402
from dflash.train.step_profile import PHASE_PREFIX, phase_counts  # noqa: E402

# The SmolLM2 recipe's drafter (conf/experiment/smollm2.yaml): 5 layers of the target's shape, 5 taps.
RECIPE_DRAFTER = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=5, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, vocab_size=49152, num_target_layers=30,
                      target_layer_ids=[1, 8, 14, 20, 27], mask_token_id=2, block_size=16,
                      layer_types=["sliding_attention"] * 4 + ["full_attention"], sliding_window=2048)


# (lighter gradient checks, contiguous gradients) of each variant.
VARIANTS = {"deepspeed_defaults": (False, True), "dflash_defaults": (True, False)}


def make_engine(light: bool, contiguous: bool, zero_stage: int, bf16: bool, device: torch.device) -> TrainEngine:
    model = DFlashDraftModel(DrafterConfig(**RECIPE_DRAFTER))
    model.init_weights(0)
    deepspeed = DeepSpeedSettings(zero_stage=zero_stage, bf16=bf16, contiguous_gradients=contiguous)
    return TrainEngine(model.to(device), TrainSettings(), deepspeed, total_steps=1000, world_size=1, bf16=bf16,
                       light_checks=light)


def loss(engine: TrainEngine) -> torch.Tensor:
    """A loss that gives every parameter a gradient, cheap next to the step."""
    return sum(p.float().square().sum() for p in engine.module.parameters()) * 1e-6


def measure(engine: TrainEngine, steps: int, device: torch.device) -> dict:
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    phases = {"backward": lambda value: engine.backward(value), "step": lambda value: engine.step()}
    seconds = dict.fromkeys(phases, 0.0)
    for index in range(2 + steps):
        value = loss(engine)
        for name, run in phases.items():
            synchronize()
            started = time.perf_counter()
            run(value)
            if index >= 2:
                seconds[name] += time.perf_counter() - started
        synchronize()
    value = loss(engine)
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        for name, run in phases.items():
            with record_function(PHASE_PREFIX + name):
                run(value)
    counts = phase_counts(trace.events())
    report = {name: {"dispatched_operators": counts[PHASE_PREFIX + name].operators,
                     "ms": round(1000 * seconds[name] / steps, 2)} for name in phases}
    return {**report, "grad_norm": engine.grad_norm()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--fp32", action="store_true", help="no bf16 (DeepSpeed then checks no gradient itself)")
    args = parser.parse_args()
    init_distributed()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "zero_stage": args.zero_stage, "bf16": not args.fp32}
    for name, (light, contiguous) in VARIANTS.items():
        engine = make_engine(light, contiguous, args.zero_stage, not args.fp32, device)
        report[name] = {"light_checks": engine.light_gradient_checks, "contiguous_gradients": contiguous,
                        **measure(engine, args.steps, device)}
        report["parameter_tensors"] = len(list(engine.module.parameters()))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

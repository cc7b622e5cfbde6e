"""The host's work in one ZeRO optimizer step of the SmolLM2 recipe's drafter, with and without the lighter gradient
checks (dflash/train/engine.py, lighten_gradient_checks); print JSON.

    python bench/optimizer_step.py                  # bf16, ZeRO-2, the recipe's 5-layer drafter (58 tensors)
    python bench/optimizer_step.py --steps 20 --zero-stage 1

For each variant: the operators Python dispatched in engine.step() (an aten call inside another counts with its
caller), all aten calls, and the step's wall milliseconds (mean of --steps after two warm-up steps; on a GPU the
host's time to issue the step, which a host-bound training step waits for). On a CPU the operator counts are those
of a GPU run, the milliseconds are not.
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

# The SmolLM2 recipe's drafter (conf/experiment/smollm2.yaml): 5 layers of the target's shape, 5 taps.
RECIPE_DRAFTER = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=5, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, vocab_size=49152, num_target_layers=30,
                      target_layer_ids=[1, 8, 14, 20, 27], mask_token_id=2, block_size=16,
                      layer_types=["sliding_attention"] * 4 + ["full_attention"], sliding_window=2048)


def make_engine(light: bool, zero_stage: int, bf16: bool, device: torch.device) -> TrainEngine:
    model = DFlashDraftModel(DrafterConfig(**RECIPE_DRAFTER))
    model.init_weights(0)
    return TrainEngine(model.to(device), TrainSettings(), DeepSpeedSettings(zero_stage=zero_stage, bf16=bf16),
                       total_steps=1000, world_size=1, bf16=bf16, light_checks=light)


def backward(engine: TrainEngine) -> None:
    """A loss that gives every parameter a gradient, cheap next to the step."""
    loss = sum(p.float().square().sum() for p in engine.module.parameters()) * 1e-6
    engine.backward(loss)


def measure(engine: TrainEngine, steps: int, device: torch.device) -> dict:
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(2):
        backward(engine)
        engine.step()
    seconds = 0.0
    for _ in range(steps):
        backward(engine)
        synchronize()
        started = time.perf_counter()
        engine.step()
        seconds += time.perf_counter() - started
        synchronize()
    backward(engine)
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        with record_function("optimizer step"):
            engine.step()
    step = next(e for e in trace.events() if e.name == "optimizer step")
    dispatched, every = 0, 0
    pending = list(step.cpu_children)
    while pending:
        event = pending.pop()
        if event.name.startswith("aten::"):
            dispatched += 1
            every += 1 + sum(1 for _ in nested_aten(event))
        else:
            pending.extend(event.cpu_children)
    return {"dispatched_operators": dispatched, "aten_calls": every, "step_ms": round(1000 * seconds / steps, 2),
            "grad_norm": engine.grad_norm()}


def nested_aten(event):
    for child in event.cpu_children:
        if child.name.startswith("aten::"):
            yield child
        yield from nested_aten(child)


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
    for name, light in (("deepspeed_checks", False), ("light_checks", True)):
        engine = make_engine(light, args.zero_stage, not args.fp32, device)
        report[name] = {"applied": engine.light_gradient_checks, **measure(engine, args.steps, device)}
        report["parameter_tensors"] = len(list(engine.module.parameters()))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

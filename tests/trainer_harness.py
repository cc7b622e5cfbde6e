"""A synthetic feature store and a one-call training run, shared by the in-process and torchrun trainer tests."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from dflash.models.drafter_config import DrafterConfig
from dflash.config.schema import DeepSpeedSettings, TrainSettings
from dflash.train.loop import train
from dflash.train.metrics_log import MetricsLog

HIDDEN, VOCAB, TAPS = 32, 64, 2


def synthetic_store(num_samples: int = 6, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(num_samples):
        length = 12 + 3 * i
        loss_mask = torch.zeros(length, dtype=torch.long)
        loss_mask[4:] = 1
        samples.append({
            "input_ids": torch.randint(0, VOCAB - 1, (length,), generator=generator),
            "loss_mask": loss_mask,
            "hidden": torch.randn(length, TAPS * HIDDEN, generator=generator),
        })
    return samples


def frozen_head(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    embed = torch.randn(VOCAB, HIDDEN, generator=generator)
    return embed, torch.randn(VOCAB, HIDDEN, generator=generator) * 0.2


def drafter_config() -> DrafterConfig:
    return DrafterConfig(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, num_target_layers=4,
                         target_layer_ids=[0, 2], mask_token_id=VOCAB - 1, block_size=4,
                         layer_types=["sliding_attention", "full_attention"], sliding_window=8)


def settings(micro_batch_size: int, grad_accum: int, epochs: int = 2, save_every: int = 0,
             keep_last: int = 0) -> TrainSettings:
    return TrainSettings(epochs=epochs, micro_batch_size=micro_batch_size, grad_accum=grad_accum, lr=3e-3,
                         weight_decay=0.0, betas=(0.9, 0.95), warmup_ratio=0.0, min_lr_ratio=0.1, grad_clip=1.0,
                         num_anchors=4, gamma=4.0, seed=0, loss_chunk_size=7, log_every=1, save_every=save_every,
                         attention="sdpa", keep_last=keep_last)


class SlowStore(list):
    """A store that takes `delay` seconds per sample, so a test can kill a run between two checkpoints."""

    def __init__(self, samples: list, delay: float) -> None:
        super().__init__(samples)
        self.delay = delay

    def __getitem__(self, index):
        time.sleep(self.delay)
        return super().__getitem__(index)


def run(out_dir: str, micro_batch_size: int, grad_accum: int, zero_stage: int = 2, epochs: int = 2,
        save_every: int = 0, keep_last: int = 0, delay: float = 0.0,
        device: str = "cpu") -> tuple[list[float], dict[str, torch.Tensor]]:
    from dflash.train.engine import init_distributed

    rank, world_size, local_rank = init_distributed()
    log = MetricsLog(out_dir, enabled=rank == 0, tensorboard=False, wandb_mode="disabled", wandb_project="t",
                     config={})
    store = SlowStore(synthetic_store(), delay) if delay else synthetic_store()
    state = train(settings(micro_batch_size, grad_accum, epochs, save_every, keep_last), drafter_config(),
                  store, frozen_head(), os.path.join(out_dir, "checkpoints"), log,
                  deepspeed=DeepSpeedSettings(zero_stage=zero_stage, bf16=False), rank=rank, world_size=world_size,
                  device=torch.device("cuda", local_rank) if device == "cuda" else torch.device("cpu"),
                  show_progress=False)
    log.close()
    losses = []
    if rank == 0:
        with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
            losses = [json.loads(line)["loss"] for line in f]
    return losses, state


def main(out_dir: str, micro_batch_size: int, grad_accum: int, zero_stage: int, epochs: int = 2, save_every: int = 0,
         keep_last: int = 0, delay: float = 0.0, device: str = "cpu") -> None:
    """One rank of a launched run (torchrun, or tests/forked.py's run_ranks): rank 0 saves the losses and the final
    state to OUT_DIR/result.pt."""
    torch.set_num_threads(1)
    losses, state = run(out_dir, micro_batch_size, grad_accum, zero_stage, epochs, save_every, keep_last, delay, device)
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save({"losses": losses, "state": state}, os.path.join(out_dir, "result.pt"))


if __name__ == "__main__":
    # [torchrun ...] tests/trainer_harness.py OUT_DIR MICRO GRAD_ACCUM ZERO_STAGE [--epochs E --save-every N ...]
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("micro", type=int)
    parser.add_argument("accum", type=int)
    parser.add_argument("stage", type=int)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--keep-last", type=int, default=0)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")  # cuda: rank r on cuda:r, NCCL
    args = parser.parse_args()
    main(args.out, args.micro, args.accum, args.stage, args.epochs, args.save_every, args.keep_last, args.delay,
         args.device)

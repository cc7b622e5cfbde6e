"""The drafter training loop: read it top to bottom.

Each optimizer step: take this rank's micro-batches of the global batch, count the loss weight of the WHOLE global
batch (all micro-batches, all ranks), then run forward/backward per micro-batch with the loss divided by that
global count. The gradient is then that of one big batch, whatever the split into ranks and accumulation steps
(the engine averages over ranks and accumulation steps, so the loss is scaled back up by both).

With a held-out set, every `eval_every` steps and at the last step the drafter's greedy acceptance is replayed on
it (dflash/train/heldout.py), logged as heldout/*, and the weights with the best tau so far are kept in
checkpoints/best/ (dflash/train/best_checkpoint.py). The evaluation draws no random numbers, so it changes nothing
in training, and it runs before the step's checkpoint, so a resumed run has seen every evaluation it restores.

With settings.max_minutes, a TimeBudget (dflash/train/time_budget.py) is told when each step and evaluation ends and
plans the total of steps that fits; the LR schedule, the last step and its evaluation and checkpoint follow the plan.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function
from tqdm import tqdm

from dflash.config.schema import DeepSpeedSettings, TrainSettings
from dflash.host_copy import host_to_device
from dflash.models.drafter import DFlashDraftModel
from dflash.models.drafter_config import DrafterConfig
from dflash.train.activation_checkpointing import apply_activation_checkpointing
from dflash.data.batch_plan import BatchPlan
from dflash.train.batches import batch_to_device, prepare_micro_batch
from dflash.train.best_checkpoint import clear_best, read_best, write_best
from dflash.train.checkpoints import load_checkpoint, resume_tag, save_checkpoint
from dflash.train.compile_layers import compile_layers
from dflash.train.engine import OptimConfig, TrainEngine
from dflash.train.forward import resolve_attention, training_forward
from dflash.train.heldout import HeldoutSet
from dflash.train.step_profile import StepProfiler, in_window, parse_profile_steps
from dflash.train.stop_signal import StopSignal, TrainingStopped
from dflash.train.time_budget import TimeBudget
from dflash.train.metrics_log import MetricsLog
from dflash.train.objective import (
    block_target_hidden, loss_normaliser, weighted_block_loss,
)
from dflash.train.step_metrics import expected_acceptance_length, measure_matmul_tflops, step_flops


# Named ranges of a step, shown as rows of the train.profile_steps tables (host and device time per phase).
PHASE_BATCHES = "dflash: batches (features, anchors, labels)"
PHASE_FORWARD = "dflash: drafter forward"
PHASE_LOSS = "dflash: loss"
PHASE_BACKWARD = "dflash: backward"
PHASE_OPTIMIZER = "dflash: optimizer step"
PHASE_METRICS = "dflash: step metrics"
PHASE_CHECKS = "dflash: feature checks"


# Every time the loop reads (a test replaces it with a scripted clock).
clock = time.perf_counter


def global_sum(value: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value)
    return value


def resolve_bf16(setting: bool | str, device: torch.device) -> bool:
    """deepspeed.bf16: auto = bf16 (with fp32 master weights) on CUDA, fp32 elsewhere."""
    return torch.device(device).type == "cuda" if setting == "auto" else bool(setting)


def build_engine(settings: TrainSettings, deepspeed: DeepSpeedSettings, drafter_config: DrafterConfig,
                 total_steps: int, world_size: int, device: torch.device, load_universal: bool = False) -> TrainEngine:
    drafter = DFlashDraftModel(drafter_config)
    drafter.init_weights(settings.seed)
    if settings.activation_checkpointing:
        apply_activation_checkpointing(drafter)
    if settings.compile:
        compile_layers(drafter)
    optim = OptimConfig(
        lr=settings.lr, weight_decay=settings.weight_decay, betas=tuple(settings.betas),
        warmup_ratio=settings.warmup_ratio, min_lr_ratio=settings.min_lr_ratio, grad_clip=settings.grad_clip,
        zero_stage=deepspeed.zero_stage, bf16=resolve_bf16(deepspeed.bf16, device),
        micro_batch_size=settings.micro_batch_size,
        grad_accum=settings.grad_accum, total_steps=total_steps, load_universal=load_universal,
    )
    return TrainEngine(drafter.to(device), optim, world_size)


def train_step(engine: TrainEngine, embed_weight: torch.Tensor, lm_head: torch.Tensor, micro_batches: list[dict],
               settings: TrainSettings, world_size: int, attention: str = "sdpa") -> dict[str, float]:
    """One optimizer step over this rank's micro-batches; returns the step's global loss, accuracies, FLOPs.

    The denominator is counted before any forward: the exp-decay weight sum, or for D-PACE (whose weights exist
    only after the forward) the number of valid anchors, so the split into ranks and micro-batches never matters.
    With settings.kl_weight > 0 every micro-batch must hold "target_final" [b, T, H] (colocated capture).
    """
    device = engine.device
    local_weight = sum(loss_normaliser(batch["weights"], settings.loss_weighting) for batch in micro_batches)
    # Queued behind the colocated target's forward (launched in the batches phase), not waited for.
    local_weight = host_to_device(local_weight.float(), device)
    total_weight = global_sum(local_weight).clamp_min(1e-12)
    block_size = micro_batches[0]["labels"].shape[-1]
    totals = torch.zeros(4 + 2 * block_size, device=device)  # loss, tokens, queries, context, correct, counted
    for batch in micro_batches:
        # Queued copies that never wait for the GPU (a blocking host-to-device copy stalls the host until the
        # stream drains, leaving the GPU idle while the next kernels are launched).
        batch = batch_to_device(batch, device, engine.dtype)
        anchors = batch["anchors"]
        with record_function(PHASE_FORWARD):
            hidden = training_forward(engine, embed_weight, batch["input_ids"], batch["hidden"], anchors,
                                      attention=attention)
        target_hidden = None
        if settings.kl_weight > 0:
            if "target_final" not in batch:
                raise ValueError(f"train.kl_weight={settings.kl_weight} needs the target's final hidden states "
                                 "(\"target_final\"), which only capture.mode=colocated provides")
            target_hidden = block_target_hidden(batch["target_final"], anchors, block_size)
        with record_function(PHASE_LOSS):
            loss_sum, _, correct, counted = weighted_block_loss(
                hidden, lm_head, batch["labels"], batch["weights"], settings.loss_chunk_size,
                settings.loss_weighting, settings.dpace_alpha, settings.kl_weight, target_hidden,
                rows=batch.get("loss_rows"),
            )
            # `0 * hidden.sum()` keeps every parameter in the graph when a micro-batch holds only placeholders.
            scaled = loss_sum * (world_size * settings.grad_accum) / total_weight + 0.0 * hidden.sum()
        with record_function(PHASE_BACKWARD):
            engine.backward(scaled)
        with record_function(PHASE_OPTIMIZER):
            engine.step()
        tokens = batch["input_ids"].shape[0] * batch["input_ids"].shape[1]
        totals[0] += loss_sum.detach()
        for index, size in ((1, tokens), (2, batch["labels"].numel()), (3, tokens)):
            totals[index] += size  # a Python number goes to the kernel as an argument: no host-to-device copy
        totals[4:] += torch.cat([correct, counted])
    with record_function(PHASE_METRICS):
        return step_metrics(engine, totals, total_weight, block_size)


def step_metrics(engine: TrainEngine, totals: torch.Tensor, total_weight: torch.Tensor,
                 block_size: int) -> dict[str, float]:
    """The logged figures of one step from its summed totals, in one device-to-host transfer."""
    totals = global_sum(totals)
    correct, counted = totals[4 : 4 + block_size], totals[4 + block_size :]
    # One device-to-host transfer for every logged figure (each .item() would be a separate wait for the GPU).
    loss, tokens, queries, context, acc, *accuracies = torch.cat([
        (totals[0] / total_weight).reshape(1), totals[1:4],
        (correct[1:].sum() / counted[1:].sum().clamp_min(1)).reshape(1), correct[1:] / counted[1:].clamp_min(1),
    ]).tolist()
    metrics = {"loss": loss, "tokens": tokens, "acc": acc}
    for k, accuracy in enumerate(accuracies, start=1):
        metrics[f"acc_pos{k}"] = accuracy
    metrics["accept_len_est"] = expected_acceptance_length(accuracies)
    metrics["flops"] = step_flops(engine.config, int(queries), int(context))
    return metrics


def evaluate_heldout(engine: TrainEngine, heldout: HeldoutSet, frozen_head: tuple[torch.Tensor, torch.Tensor],
                     rank: int) -> tuple[dict[str, float] | None, dict[str, torch.Tensor] | None]:
    """Rank 0: (held-out metrics of the current weights, their consolidated state if it was gathered); elsewhere
    (None, None). Collective under ZeRO-3, so every rank must call it."""
    if engine.zero_stage == 3:
        # ZeRO-3 forward hooks gather and re-shard parameters collectively, so rank 0 alone cannot run the
        # trained module: every rank joins the consolidation and rank 0 replays a plain copy.
        state = engine.consolidated_state_dict()
        if rank != 0:
            return None, None
        with torch.device("meta"):  # no initialisation: draws nothing from the RNG that training uses
            drafter = DFlashDraftModel(engine.config)
        drafter.load_state_dict(state, assign=True)
        return heldout.evaluate(drafter.to(engine.device), frozen_head), state
    if rank != 0:
        return None, None
    return heldout.evaluate(engine.module, frozen_head), None


def agreed_seconds(seconds: float, device: torch.device) -> float:
    """`seconds` as measured on this rank, the largest over all ranks, so every rank plans the same steps."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        seconds = value.item()
    return seconds


def follow_plan(budget: TimeBudget, engine: TrainEngine, progress: tqdm, total_steps: int, news: bool,
                rank: int) -> int:
    """The total of steps the budget now plans: the LR schedule and the progress bar follow it, and a line says so
    when the plan was set or changed."""
    if news and rank == 0:
        print(budget.describe(total_steps), flush=True)
    if budget.planned_steps != total_steps:
        engine.set_total_steps(budget.planned_steps)
        progress.total = budget.planned_steps
        progress.refresh()
    return budget.planned_steps


def resolve_peak_tflops(value: float | str | None, device: torch.device) -> float | None:
    """Per-rank peak TFLOP/s for MFU: a number as given; 'auto' measures a bf16 matmul on CUDA (None on CPU)."""
    if value is None or (value == "auto" and device.type != "cuda"):
        return None
    if value == "auto":
        return measure_matmul_tflops(device)
    return float(value)


def train(settings: TrainSettings, drafter_config: DrafterConfig, store: Sequence[dict[str, torch.Tensor]],
          frozen_head: tuple[torch.Tensor, torch.Tensor], checkpoint_dir: str, log: MetricsLog, *,
          deepspeed: DeepSpeedSettings | None = None, rank: int, world_size: int, device: torch.device,
          show_progress: bool = True, heldout: HeldoutSet | None = None, lengths: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
    """Train to the end (resuming from the latest checkpoint) and return the drafter's state dict on CPU.

    store: samples {"input_ids", "loss_mask", "hidden"} (a FeatureStore, or any sequence of such dicts);
    frozen_head: the target's (embedding weight, lm_head weight); heldout: evaluated every
    settings.eval_every steps and at the last step, the best weights kept in checkpoint_dir/best.
    lengths: every sample's token count, needed by settings.group_by_length. deepspeed: ZeRO stage and precision
    (default: ZeRO-2, bf16 on CUDA).
    """
    if heldout is None and settings.eval_every:
        raise ValueError(f"eval_every={settings.eval_every} needs a held-out set (data.heldout > 0)")
    if heldout is not None:
        heldout.check(drafter_config)
    entered = clock()
    embed_weight, lm_head = (w.to(device) for w in frozen_head)
    plan = BatchPlan(len(store), settings.micro_batch_size, world_size, settings.grad_accum, settings.seed,
                     group_by_length=settings.group_by_length,
                     lengths=tuple(lengths) if settings.group_by_length and lengths is not None else None)
    total_steps = plan.steps_per_epoch * settings.epochs
    if settings.max_steps is not None:
        if settings.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 or None, got {settings.max_steps}")
        total_steps = min(total_steps, settings.max_steps)
    tag, universal = resume_tag(checkpoint_dir, world_size, rank)
    engine = build_engine(settings, deepspeed or DeepSpeedSettings(), drafter_config, total_steps, world_size, device,
                          load_universal=universal)
    attention = resolve_attention(settings.attention, device)
    peak_tflops = resolve_peak_tflops(settings.peak_tflops, device)
    # Data position, anchors and LR all follow from the global step, restored with the optimizer and RNG state.
    state = {"global_step": 0} if tag is None else load_checkpoint(engine, checkpoint_dir, tag, rank=rank)
    step = state["global_step"]
    log.resume_from(step)  # records of steps after the checkpoint (or of an earlier run) are not this run's
    saved_batch = state.get("global_batch_size", plan.global_batch_size)
    if saved_batch != plan.global_batch_size:
        raise ValueError(
            f"checkpoint {tag} was trained with a global batch of {saved_batch} samples, this run has "
            f"{plan.global_batch_size} (micro_batch_size x ranks x grad_accum): the data position would not match; "
            f"set train.grad_accum so the global batch is {saved_batch}"
        )
    budget = None
    if settings.max_minutes is not None:  # the schedule ends within the budget (dflash/train/time_budget.py)
        budget = TimeBudget(settings.max_minutes, total_steps, eval_every=settings.eval_every,
                            evaluates=heldout is not None, save_every=settings.save_every,
                            saved=state.get("time_budget"))
    best: dict[str, Any] | None = None
    if rank == 0:
        if tag is None:
            clear_best(checkpoint_dir)  # a best left by an earlier run in this folder is not this run's
        else:
            best = read_best(checkpoint_dir)
    progress = tqdm(total=total_steps, initial=step, desc="train", disable=not (show_progress and rank == 0))
    if budget is not None:  # a resumed run goes on with its saved plan
        total_steps = follow_plan(budget, engine, progress, total_steps, budget.planned_steps != total_steps, rank)
    profile_window = parse_profile_steps(settings.profile_steps)
    profiler = StepProfiler(settings.profile_steps, os.path.join(os.path.dirname(os.path.abspath(checkpoint_dir)),
                                                                 "train_profile.txt"), device, enabled=rank == 0)
    first_step = True
    # Since the last log line, for step_s and tokens_per_s: each log line reports its own window, so the first
    # steps' compilation weighs only on the first line.
    window_started, window_step, window_eval_s, window_tokens = clock(), step, 0.0, 0.0
    verify_features = getattr(store, "verify_features", None)
    # A SIGTERM / SIGUSR1 (a scheduler's warning) finishes the step, saves it on every rank, and stops.
    with StopSignal() as stop, contextlib.ExitStack() as cleanup:
        cleanup.callback(lambda: profiler.close(step))  # however the loop ends, the profiler stops here
        while step < total_steps:
            profiler.before_step(step + 1)
            step_started = clock()
            epoch, step_in_epoch = divmod(step, plan.steps_per_epoch)
            with record_function(PHASE_BATCHES):
                micro_batches = [
                    prepare_micro_batch(store, slots, epoch=epoch, seed=settings.seed,
                                        num_anchors=settings.num_anchors, block_size=drafter_config.block_size,
                                        gamma=settings.gamma, pin_memory=torch.device(device).type == "cuda")
                    for slots in plan.micro_batches(epoch, step_in_epoch, rank)
                ]
            metrics = train_step(engine, embed_weight, lm_head, micro_batches, settings, world_size, attention)
            if verify_features is not None:
                with record_function(PHASE_CHECKS):
                    verify_features()  # colocated capture: this step's feature checks, read after the step's sync
            if first_step and rank == 0:
                # Where a (re)start spends its time: engine build + checkpoint load, then the first step's kernel
                # compilation (flex attention), both paid again by every resumed call.
                print(f"[train] ready after {step_started - entered:.1f} s (engine, checkpoint); first step "
                      f"{clock() - step_started:.1f} s", flush=True)
            first_step = False
            step += 1
            now = step_ended = clock()
            profiled = in_window(profile_window, step)  # the same on every rank: from the settings
            if budget is not None:
                if profiled:  # slower under the profiler than the steps to come: out of the step rate
                    budget.exclude(agreed_seconds(step_ended - step_started, device))
                news = budget.after_step(step, agreed_seconds(clock() - entered, device), profiled=profiled)
                total_steps = follow_plan(budget, engine, progress, total_steps, news, rank)
            window_tokens += metrics.pop("tokens")
            tflops = metrics.pop("flops") / (now - step_started) / 1e12
            metrics.update(lr=engine.lr(), epoch=epoch + step_in_epoch / plan.steps_per_epoch, tflops=tflops)
            if peak_tflops is not None:
                metrics["mfu"] = tflops / (peak_tflops * world_size)
            grad_norm = engine.grad_norm()
            if grad_norm is not None:
                metrics["grad_norm"] = grad_norm
            evaluate_now = heldout is not None and (
                step == total_steps or (settings.eval_every and step % settings.eval_every == 0))
            if evaluate_now:
                eval_started = clock()
                held, gathered = evaluate_heldout(engine, heldout, (embed_weight, lm_head), rank)
                if held is not None:
                    metrics.update({f"heldout/{key}": value for key, value in held.items()})
                    if best is None or held["tau"] > best["tau"]:
                        best = {"step": step, "tau": held["tau"], "acceptance_rate": held["acceptance_rate"]}
                        weights = gathered if gathered is not None else engine.consolidated_state_dict()
                        write_best(checkpoint_dir, weights, best)
                if world_size > 1:
                    dist.barrier()
                metrics["heldout/seconds"] = clock() - eval_started
                window_eval_s += metrics["heldout/seconds"]  # kept out of step_s and tokens/s
                if budget is not None:
                    news = budget.after_evaluation(step, agreed_seconds(clock() - entered, device))
                    total_steps = follow_plan(budget, engine, progress, total_steps, news, rank)
            if budget is not None:
                metrics.update(lr=engine.lr(), planned_steps=total_steps)  # the LR after any change of plan
            if step % settings.log_every == 0 or step == total_steps or evaluate_now:
                now = clock()
                training_s = now - window_started - window_eval_s
                metrics["step_s"] = training_s / (step - window_step)
                metrics["tokens_per_s"] = window_tokens / training_s
                window_started, window_step, window_eval_s, window_tokens = now, step, 0.0, 0.0
                log.log(step, metrics)
            progress.set_postfix(loss=f"{metrics['loss']:.3f}", acc=f"{metrics['acc']:.3f}",
                                 tau=f"{metrics['accept_len_est']:.2f}")
            progress.update(1)
            table_started = clock()
            profiler.after_step(step)  # the last profiled step writes its table here (rank 0)
            if budget is not None and profiled:  # so is the table; ranks agree on the seconds, their plans stay equal
                budget.exclude(agreed_seconds(clock() - table_started, device))
            # A signal in the last step stops too: the caller asked to stop now, not after export and eval.
            stopping = stop.requested(device)
            if stopping or step == total_steps or (settings.save_every and step % settings.save_every == 0):
                client_state = {"global_step": step, "global_batch_size": plan.global_batch_size}
                if budget is not None:
                    client_state["time_budget"] = budget.state()
                save_checkpoint(engine, checkpoint_dir, step, client_state, rank=rank, keep_last=settings.keep_last)
            if stopping:
                progress.close()
                raise TrainingStopped(step, stop.received or "a signal on another rank")
    progress.close()
    return engine.consolidated_state_dict()

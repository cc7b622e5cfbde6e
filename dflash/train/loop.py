"""The drafter training loop: `train` reads top to bottom; the bookkeeping around the steps is in components.

Each optimizer step: take this rank's micro-batches of the global batch, count the loss weight of the WHOLE global
batch (all micro-batches, all ranks), then run forward/backward per micro-batch with the loss divided by that
global count. The gradient is then that of one big batch, whatever the split into ranks and accumulation steps
(the engine averages over ranks and accumulation steps, so the loss is scaled back up by both).

Around the steps, each in its own file: the time budget (budget_pace.py feeding time_budget.py, whose plan the LR
schedule and the progress bar follow), held-out evaluation and the best checkpoint (heldout_tracker.py), the
metrics record of a step (step_records.py), the checkpoint policy (checkpoint_policy.py), the stop on non-finite
steps or weights (divergence.py), the profiler (step_profile.py) and the stop signal (stop_signal.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.profiler import record_function
from tqdm import tqdm

from dflash.config.schema import DeepSpeedSettings, TrainSettings
from dflash.data.batch_plan import BatchPlan
from dflash.data.feature_source import FeatureSource, Sample, as_feature_source
from dflash.host_copy import host_to_device
from dflash.models.drafter import DFlashDraftModel
from dflash.models.drafter_config import DrafterConfig
from dflash.models.targets.logit_transform import LogitTransform
from dflash.train.activation_checkpointing import apply_activation_checkpointing
from dflash.train.batches import batch_to_device, prepare_micro_batch
from dflash.train.budget_pace import BudgetPace
from dflash.train.checkpoint_policy import CheckpointPolicy
from dflash.train.checkpoints import resume_tag
from dflash.train.compile_layers import compile_layers
from dflash.train.divergence import DivergenceGuard
from dflash.train.engine import TrainEngine
from dflash.train.forward import resolve_attention, training_forward
from dflash.train.heldout import HeldoutSet
from dflash.train.heldout_tracker import HeldoutTracker, check_heldout
from dflash.train.metrics_log import MetricsLog
from dflash.train.objective import block_target_hidden, loss_normaliser, target_labels, weighted_block_loss
from dflash.train.step_metrics import expected_acceptance_length, measure_matmul_tflops, step_flops
from dflash.train.step_batches import StepBatches
from dflash.train.step_profile import StepProfiler, profile_path
from dflash.train.step_records import StartupPhases, StepRecords
from dflash.train.stop_signal import StopSignal
from dflash.train.time_budget import TimeBudget

logger = logging.getLogger(__name__)


# Named ranges of a step, shown as rows of the train.profile_steps tables (host and device time per phase).
PHASE_BATCHES = "dflash: batches (features, anchors, labels)"
PHASE_FORWARD = "dflash: drafter forward"
PHASE_LOSS = "dflash: loss"
PHASE_BACKWARD = "dflash: backward"
PHASE_OPTIMIZER = "dflash: optimizer step"
PHASE_METRICS = "dflash: step metrics"
PHASE_CHECKS = "dflash: feature checks"
# The training bar shows the mean of this many last steps (show_step).
BAR_MEAN_STEPS = 20


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


def build_engine(settings: TrainSettings, deepspeed: DeepSpeedSettings | None, drafter_config: DrafterConfig,
                 total_steps: int, world_size: int, device: torch.device, load_universal: bool = False) -> TrainEngine:
    """The drafter, initialised from settings.seed, wrapped in DeepSpeed (default: ZeRO-2, bf16 on CUDA)."""
    deepspeed = deepspeed or DeepSpeedSettings()
    drafter = DFlashDraftModel(drafter_config)
    drafter.init_weights(settings.seed)
    if settings.activation_checkpointing:
        apply_activation_checkpointing(drafter)
    if settings.compile:
        compile_layers(drafter)
    return TrainEngine(drafter.to(device), settings, deepspeed, total_steps, world_size,
                       bf16=resolve_bf16(deepspeed.bf16, device), load_universal=load_universal)


def train_step(engine: TrainEngine, embed_weight: torch.Tensor, lm_head: torch.Tensor, micro_batches: list[dict],
               settings: TrainSettings, world_size: int, attention: str = "sdpa",
               logit_transform: LogitTransform | None = None,
               before_update: Callable[[], None] | None = None) -> dict[str, float]:
    """One optimizer step over this rank's micro-batches; returns the step's global loss, accuracies, FLOPs.

    The denominator is counted before any forward: the exp-decay weight sum, or for D-PACE (whose weights exist
    only after the forward) the number of valid anchors, so the split into ranks and micro-batches never matters.
    With settings.kl_weight > 0 or settings.labels == "target" every micro-batch must hold "target_final"
    [b, T, H] (colocated capture).
    logit_transform: the target's final logit transform, which the loss applies to the head's logits.
    before_update: called after the last micro-batch's backward is launched, before the optimizer step waits for the
    GPU (the loop makes the next step's micro-batches there, dflash/train/step_batches.py), with the step's own
    tensors released but for what the caller's micro_batches still hold.
    """
    device = engine.device
    local_weight = sum(loss_normaliser(batch["weights"], settings.loss_weighting) for batch in micro_batches)
    # Queued behind the colocated target's forward (launched in the batches phase), not waited for.
    local_weight = host_to_device(local_weight.float(), device)
    total_weight = global_sum(local_weight).clamp_min(1e-12)
    block_size = micro_batches[0]["labels"].shape[-1]
    totals = torch.zeros(4 + 2 * block_size, device=device)  # loss, tokens, queries, context, correct, counted
    for index, batch in enumerate(micro_batches):
        final = None
        # Queued copies that never wait for the GPU (a blocking host-to-device copy stalls the host until the
        # stream drains, leaving the GPU idle while the next kernels are launched).
        batch = batch_to_device(batch, device, engine.dtype)
        anchors = batch["anchors"]
        with record_function(PHASE_FORWARD):
            hidden = training_forward(engine, embed_weight, batch["input_ids"], batch["hidden"], anchors,
                                      attention=attention)
        target_hidden, labels = None, batch["labels"]
        if settings.kl_weight > 0:
            final = target_final(batch, f"train.kl_weight={settings.kl_weight}")
            target_hidden = block_target_hidden(final, anchors, block_size)
        with record_function(PHASE_LOSS):
            if settings.labels == "target":
                labels = target_labels(labels, batch["weights"], target_final(batch, "train.labels=target"), anchors,
                                       lm_head, settings.loss_chunk_size, batch.get("loss_rows"))
            loss_sum, _, correct, counted = weighted_block_loss(
                hidden, lm_head, labels, batch["weights"], settings.loss_chunk_size,
                settings.loss_weighting, settings.dpace_alpha, settings.kl_weight, target_hidden,
                rows=batch.get("loss_rows"), transform=logit_transform,
            )
            # `0 * hidden.sum()` keeps every parameter in the graph when a micro-batch holds only placeholders.
            scaled = loss_sum * (world_size * settings.grad_accum) / total_weight + 0.0 * hidden.sum()
        with record_function(PHASE_BACKWARD):
            engine.backward(scaled)
        tokens = batch["input_ids"].shape[0] * batch["input_ids"].shape[1]
        totals[0] += loss_sum.detach()
        for slot, size in ((1, tokens), (2, batch["labels"].numel()), (3, tokens)):
            totals[slot] += size  # a Python number goes to the kernel as an argument: no host-to-device copy
        totals[4:] += torch.cat([correct, counted])
        if before_update is not None and index == len(micro_batches) - 1:
            # The next step's batches (with colocated capture, a target forward) are made beside the gradients,
            # not beside this micro-batch's activations too.
            batch = hidden = target_hidden = labels = anchors = final = scaled = loss_sum = None
            before_update()
        with record_function(PHASE_OPTIMIZER):
            engine.step()
    with record_function(PHASE_METRICS):
        return step_metrics(engine, totals, total_weight, block_size)


def target_final(batch: dict[str, torch.Tensor], setting: str) -> torch.Tensor:
    """The micro-batch's target final hidden states [b, T, H], which `setting` (named if they are missing) reads."""
    if "target_final" not in batch:
        raise ValueError(f"{setting} needs the target's final hidden states (\"target_final\"), which only "
                         "capture.mode=colocated provides")
    return batch["target_final"]


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


def follow_plan(budget: TimeBudget | None, engine: TrainEngine, progress: tqdm, total_steps: int, news: bool,
                rank: int) -> int:
    """The total of steps the budget now plans (total_steps without a budget): the LR schedule and the progress bar
    follow it, and a line says so when the plan was set or changed enough to show (TimeBudget.line)."""
    if budget is None:
        return total_steps
    if news and rank == 0:
        line = budget.line(total_steps)
        if line is not None:
            logger.info(line)
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


def plan_batches(settings: TrainSettings, num_samples: int, world_size: int,
                 lengths: Sequence[int] | None) -> BatchPlan:
    """Every epoch's global batches (dflash/data/batch_plan.py), grouped by length when settings ask for it; a
    warning when the data holds fewer samples than one global batch (the header names the configured batch)."""
    batch = settings.micro_batch_size * world_size * settings.grad_accum
    if num_samples < batch and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.warning(f"[train] warning: the data holds {num_samples} samples, fewer than a global batch of {batch}: "
                       f"each step trains on all {num_samples}, the rest of the batch zero-weight placeholders")
    return BatchPlan(num_samples, settings.micro_batch_size, world_size, settings.grad_accum, settings.seed,
                     group_by_length=settings.group_by_length,
                     lengths=tuple(lengths) if settings.group_by_length and lengths is not None else None)


def count_steps(settings: TrainSettings, plan: BatchPlan) -> int:
    """The optimizer steps of settings.epochs, capped at settings.max_steps."""
    total_steps = plan.steps_per_epoch * settings.epochs
    if settings.max_steps is not None:  # >= 1, checked by TrainSettings
        total_steps = min(total_steps, settings.max_steps)
    return total_steps


def prepare_batches(store: FeatureSource | Sequence[Sample], plan: BatchPlan, step: int, settings: TrainSettings,
                    block_size: int, rank: int, device: torch.device) -> list[dict]:
    """This rank's micro-batches of the step after `step` steps (features, anchors, labels, loss weights)."""
    epoch, step_in_epoch = divmod(step, plan.steps_per_epoch)
    with record_function(PHASE_BATCHES):
        return [
            prepare_micro_batch(store, slots, epoch=epoch, seed=settings.seed, num_anchors=settings.num_anchors,
                                block_size=block_size, gamma=settings.gamma,
                                pin_memory=torch.device(device).type == "cuda")
            for slots in plan.micro_batches(epoch, step_in_epoch, rank)
        ]


def check_features(store: FeatureSource | Sequence[Sample], made_ahead: int) -> None:
    """The source's deferred feature checks of this step, read after the step's sync (colocated capture defers
    them; the other sources check as they read and have none pending); those of the `made_ahead` micro-batches of
    the next step stay pending."""
    with record_function(PHASE_CHECKS):
        as_feature_source(store).verify_features(leave=made_ahead)


def show_step(progress: tqdm, recent: deque, metrics: dict[str, float]) -> None:
    """One step more on the progress bar, with loss, accuracy and estimated acceptance length averaged over the
    steps `recent` holds (this one added): one step's micro-batch, an epoch's short last one say, tells little."""
    recent.append((metrics["loss"], metrics["acc"], metrics["accept_len_est"]))
    loss, acc, tau = (sum(values) / len(recent) for values in zip(*recent))
    progress.set_postfix(loss=f"{loss:.3f}", acc=f"{acc:.3f}", tau=f"{tau:.2f}")
    progress.update(1)


def train(settings: TrainSettings, drafter_config: DrafterConfig, store: FeatureSource | Sequence[Sample],
          frozen_head: tuple[torch.Tensor, torch.Tensor], checkpoint_dir: str, log: MetricsLog, *,
          deepspeed: DeepSpeedSettings | None = None, rank: int, world_size: int, device: torch.device,
          show_progress: bool = True, heldout: HeldoutSet | None = None,
          lengths: Sequence[int] | None = None,
          logit_transform: LogitTransform | None = None) -> dict[str, torch.Tensor]:
    """Train to the end (resuming from the latest checkpoint) and return the drafter's state dict on CPU.

    store: the capture mode's FeatureSource (dflash/data/feature_source.py), or a list of samples in memory;
    frozen_head: the target's (embedding, lm_head) weights; heldout: replayed every settings.eval_every steps and at
    the last step, the best weights kept in checkpoint_dir/best; lengths: every sample's token count, needed by
    settings.group_by_length; deepspeed: ZeRO stage and precision (default: ZeRO-2, bf16 on CUDA); logit_transform:
    the target's final logit transform (load_logit_transform of the frozen head file)."""
    check_heldout(heldout, settings.eval_every, drafter_config, settings.best_by)
    startup = StartupPhases(clock)  # from the call's entry: the time budget counts it
    embed_weight = frozen_head[0].to(device)
    # A tied head (load_frozen_head gives one tensor twice) stays one tensor on the device.
    lm_head = embed_weight if frozen_head[1] is frozen_head[0] else frozen_head[1].to(device)
    plan = plan_batches(settings, len(store), world_size, lengths)
    total_steps = count_steps(settings, plan)
    tag, universal = resume_tag(checkpoint_dir, world_size, rank, plan.global_batch_size)
    engine = startup.timed("engine", build_engine, settings, deepspeed, drafter_config, total_steps, world_size,
                           device, universal)
    attention = resolve_attention(settings.attention, device)
    peak_tflops = startup.timed("peak matmul", resolve_peak_tflops, settings.peak_tflops, device)
    checkpoints = CheckpointPolicy(checkpoint_dir, settings, plan.global_batch_size, rank)
    divergence = DivergenceGuard(settings.max_nonfinite_steps, checkpoint_dir, rank)
    state = startup.timed("checkpoint", checkpoints.restore, engine, tag)  # data, anchors, LR: from its step
    step = state["global_step"]
    engine.align_schedule(step)
    plan = checkpoints.kept_apart(plan, as_feature_source(store), state)
    log.resume_from(step)  # records of steps after the checkpoint (or of an earlier run) are not this run's
    pace = BudgetPace(settings, total_steps, evaluates=heldout is not None, saved=state.get("time_budget"),
                      entered=startup.entered, device=device, clock=clock)
    evaluation = HeldoutTracker(heldout, settings.eval_every, checkpoint_dir, (embed_weight, lm_head),
                                resumed=tag is not None, rank=rank, world_size=world_size, clock=clock,
                                best_by=settings.best_by, resumed_at=step)
    progress = tqdm(total=total_steps, initial=step, desc="train", disable=not (show_progress and rank == 0))
    bar_steps: deque = deque(maxlen=BAR_MEAN_STEPS)
    total_steps = follow_plan(pace.budget, engine, progress, total_steps, pace.resumed_plan(total_steps), rank)
    profiler = StepProfiler(settings.profile_steps, profile_path(checkpoint_dir), device, enabled=rank == 0)
    records = StepRecords(log, engine, first_step=step, log_every=settings.log_every,
                          steps_per_epoch=plan.steps_per_epoch, peak_tflops=peak_tflops, world_size=world_size,
                          budgeted=pace.budget is not None, startup=startup, announce=rank == 0, clock=clock)
    block_size = drafter_config.block_size
    batches = StepBatches(lambda at: prepare_batches(store, plan, at, settings, block_size, rank, device),
                          ahead=settings.prepare_ahead and as_feature_source(store).serves_ahead())
    with StopSignal() as stop, contextlib.ExitStack() as cleanup:  # a SIGTERM: finish the step, save it, stop
        cleanup.callback(progress.close)
        cleanup.callback(lambda: profiler.close(step))  # however the loop ends, the profiler stops here
        while step < total_steps:
            profiler.before_step(step + 1)
            started = clock()
            metrics = train_step(engine, embed_weight, lm_head, batches.of(step), settings, world_size, attention,
                                 logit_transform, before_update=lambda: batches.make_ahead(step + 1, total_steps))
            check_features(store, batches.pending)
            step += 1
            records.add_step(metrics, step, started)
            divergence.after_step(engine, step, metrics)  # stops after train.max_nonfinite_steps in a row
            news = pace.after_step(step, started, profiler.profiles(step))
            total_steps = follow_plan(pace.budget, engine, progress, total_steps, news, rank)
            if evaluation.due(step, total_steps):
                divergence.check_weights(engine, step)  # no best checkpoint with a non-finite weight
                metrics.update(evaluation.run(engine, step))
                total_steps = follow_plan(pace.budget, engine, progress, total_steps, pace.after_evaluation(step), rank)
            records.write(step, metrics, total_steps)
            show_step(progress, bar_steps, metrics)
            with pace.left_out(profiler.profiles(step)):
                profiler.after_step(step)  # the last profiled step writes its table here (rank 0)
            stopping = stop.requested(device)  # in the last step too: stop now, not after export and eval
            if checkpoints.due(step, total_steps, stopping):
                divergence.check_weights(engine, step)  # no checkpoint with a non-finite weight
                log.sync()  # the records of the steps it holds reach the disk before it does (a resume skips them)
                checkpoints.save(engine, step, pace.budget)
            if stopping:
                raise stop.stopped(step)
        if stop.requested(device):  # received while the last step was saved: that step is kept, export is not run
            raise stop.stopped(step)
    return engine.consolidated_state_dict()

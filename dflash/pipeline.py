"""The whole run: data -> capture -> train -> eval, each stage a folder under run_dir with a fingerprint.

A stage is skipped when its folder holds a `done.json` whose fingerprint equals the current one (the settings that
decide its output plus the fingerprint of its input stage), so rerunning a run resumes it and changing a setting
redoes exactly the stages it affects. Under a multi-process launcher the train stage runs on every rank, and so
does offline capture (each rank captures its share of the shards); rank 0 does data and eval while the rest wait
at a barrier.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from dflash.config import ConfigError, fingerprints, settings_from
from dflash.config.errors import NothingToEvaluate, RunFolderError
from dflash.run_files import (
    CHECKPOINT_KEY, claim_checkpoint_dir, claim_dir, clear_done, container, fingerprint, mark_done, read_json,
    read_json_or_none, stage_done, write_json, write_text,
)


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(name)


# Target shape and drafter config ---------------------------------------------------------------------------------

def target_shape(adapter) -> dict[str, Any]:
    config = adapter.config
    heads = int(config.num_attention_heads)
    return {
        "model_type": adapter.model_type,
        "num_layers": adapter.num_layers,
        "hidden_size": adapter.hidden_size,
        "vocab_size": adapter.vocab_size,
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(config, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(config, "head_dim", None) or adapter.hidden_size // heads),
        "intermediate_size": int(config.intermediate_size),
    }


def drafter_config(cfg: DictConfig, shape: dict[str, Any]):
    """The DrafterConfig of this run: the drafter group, with null fields taken from the target."""
    from dflash.models.drafter_config import DrafterConfig, default_target_layer_ids

    d = cfg.drafter
    if d.hidden_size is not None and int(d.hidden_size) != shape["hidden_size"]:
        raise ValueError(
            f"drafter.hidden_size {d.hidden_size} differs from the target's hidden size {shape['hidden_size']}: "
            f"the drafter shares the target's embedding and lm_head, so they must be equal"
        )
    layer_ids = list(d.target_layer_ids) if d.target_layer_ids is not None else \
        default_target_layer_ids(shape["num_layers"], int(d.num_taps))
    mask = cfg.target.mask_token_id
    pick = lambda key: int(getattr(d, key)) if getattr(d, key) is not None else shape[key]  # noqa: E731
    return DrafterConfig(
        hidden_size=shape["hidden_size"],
        intermediate_size=pick("intermediate_size"),
        num_hidden_layers=int(d.num_hidden_layers),
        num_attention_heads=pick("num_attention_heads"),
        num_key_value_heads=pick("num_key_value_heads"),
        head_dim=pick("head_dim"),
        vocab_size=shape["vocab_size"],
        num_target_layers=shape["num_layers"],
        target_layer_ids=layer_ids,
        mask_token_id=int(mask) if mask is not None else shape["vocab_size"] - 1,
        block_size=int(d.block_size),
        layer_types=list(d.layer_types) if d.layer_types is not None else [],
        sliding_window=d.sliding_window,
        rope_theta=float(d.rope_theta),
    )


def run_command(cfg: DictConfig, stages: list[str] | None = None) -> dict[str, Any] | None:
    """What the commands run: the pipeline over `stages` (default: cfg.stages). A bad setting, or a run folder that
    holds a drafter of other settings, ends the process with one line (exit status 2; HYDRA_FULL_ERROR=1 shows the
    traceback) before any work."""
    from dflash.train.stop_signal import TrainingStopped

    if stages is not None:
        cfg.stages = stages
    try:
        return Pipeline(cfg).run()
    except ConfigError as error:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"dflash: error: {error}", file=sys.stderr, flush=True)
        remove_hydra_only_dir(str(cfg.run_dir))
        sys.exit(2)
    except TrainingStopped as stopped:
        print(f"[train] {stopped}", flush=True)
        sys.exit(128 + 15)  # the exit status of a process ended by SIGTERM: not done, resumable


def remove_hydra_only_dir(run_dir: str) -> None:
    """Remove a run folder that holds nothing but the log folder Hydra made for this refused command, so a refused
    run leaves nothing behind. A folder holding anything else is left as it is."""
    logs = os.path.join(run_dir, "hydra")
    if os.path.isdir(run_dir) and os.listdir(run_dir) == ["hydra"] and \
            all(name.endswith(".log") for name in os.listdir(logs)):
        shutil.rmtree(run_dir)


def prompt_set_specs(e) -> dict[str, dict[str, Any]]:
    """eval.prompt_sets as the plain {name: {source, limit, ...}} dicts load_prompt_sets reads (null keys left out)."""
    return {name: {k: v for k, v in dataclasses.asdict(spec).items() if v is not None}
            for name, spec in e.prompt_sets.items()}


def timed(stage: str, work):
    """work() with its wall time printed: where a run's minutes go is the first question after a long run."""
    started = time.perf_counter()
    result = work()
    print(f"[{stage}] stage took {time.perf_counter() - started:.1f} s", flush=True)
    return result


# The pipeline ------------------------------------------------------------------------------------------------------

# What a training leaves in the run folder beside its checkpoints: its logs (metrics_log.py), exports, curve and the
# evaluation of its export. They travel with the checkpoints when those are moved aside (overwrite=true) or back.
SETTINGS_KEY = "settings.json"  # in checkpoints/: the settings fingerprint of the training that wrote them
TRAINED_OUTPUTS = ("metrics.jsonl", "tensorboard", "export", "export_best", "training_curve.png", "eval")


class Pipeline:
    def __init__(self, cfg: DictConfig) -> None:
        self.settings = settings_from(cfg)  # every setting checked (ConfigError naming the key) before any work
        self.cfg = cfg
        self.run_dir = os.path.abspath(self.settings.run_dir)
        self.dirs = {stage: os.path.join(self.run_dir, stage) for stage in ("data", "features", "checkpoints",
                                                                            "export", "eval")}
        if self.settings.eval.out_dir:  # several evaluations of one run (live, T=1, other sets) side by side
            self.dirs["eval"] = os.path.abspath(self.settings.eval.out_dir)
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = resolve_device(self.settings.device, self.local_rank)
        self.show_progress = self.settings.show_progress
        self._adapter = None

    # Shared pieces

    @property
    def adapter(self):
        if self._adapter is None:
            from dflash.models.targets import load_target

            t, c = self.settings.target, self.settings.capture
            device: str | list[str] = str(self.device)
            if self.device.type == "cuda" and c.mode != "colocated":
                from dflash.models.targets.placement import rank_devices, resolve_gpus_per_worker

                # A target larger than one GPU: this process takes its g consecutive GPUs (docs/capture.md).
                g = resolve_gpus_per_worker(c.gpus_per_worker, dataclasses.asdict(t),
                                            len(c.devices) if c.devices is not None else 1)
                if g > 1:
                    device = rank_devices(self.local_rank, g)
            self._adapter = load_target(t.kind, path=t.path, dtype=t.dtype, device=device, tiny=t.tiny,
                                        cache_dir=t.cache_dir)
        return self._adapter

    def trained_keys(self) -> tuple[str, str | None] | None:
        """(checkpoint fingerprint, settings fingerprint or None when not recorded) of the drafter trained in
        run_dir (its export's, else its checkpoints'), or None when nothing was trained there."""
        from dflash.train.best_checkpoint import read_best
        from dflash.train.checkpoints import complete_tags

        folder = self.dirs["checkpoints"]
        marker = read_json_or_none(os.path.join(folder, CHECKPOINT_KEY))
        checkpoints = marker.get("fingerprint") if isinstance(marker, dict) else "unfingerprinted"
        settings = (read_json_or_none(os.path.join(folder, SETTINGS_KEY)) or {}).get("fingerprint")
        export = read_json_or_none(os.path.join(self.dirs["export"], "done.json"))
        if isinstance(export, dict) and "checkpoint" in export:
            return export["checkpoint"], settings if export["checkpoint"] == checkpoints else None
        if not complete_tags(folder) and read_best(folder) is None:
            return None
        return checkpoints, settings

    def refuse_other_trained_settings(self) -> None:
        """ConfigError, before any work, when run_dir holds a drafter trained under other data, capture or train
        settings: a command is never allowed to move, rewrite or delete a trained run unless it says overwrite=true
        (the trained drafter is then moved aside, never deleted). Other eval settings are fine."""
        trained = self.trained_keys()
        if self.settings.overwrite or trained is None:
            return
        # The settings alone when recorded: the data stage may not have (re)made its files yet.
        if trained[1] == fingerprints.settings_fingerprint(self.settings) or \
                trained[1] is None and trained[0] == self.checkpoint_fingerprint():
            return
        old = None
        for path in (os.path.join(self.dirs["checkpoints"], "config.yaml"), os.path.join(self.run_dir, "config.yaml")):
            if os.path.exists(path):
                old = OmegaConf.to_container(OmegaConf.load(path))
                break
        changes = fingerprints.training_changes(old, self.settings) if isinstance(old, dict) else []
        shown = "; ".join(changes[:5]) + (f"; and {len(changes) - 5} more" if len(changes) > 5 else "")
        parent, name = os.path.split(self.run_dir)
        free = next(f"{name}-{k}" for k in range(2, 10_000) if not os.path.exists(os.path.join(parent, f"{name}-{k}")))
        raise RunFolderError(
            f"{self.run_dir} holds a drafter trained with other settings ({shown or 'see its config.yaml'}); nothing "
            f"was changed. To train these settings beside it, run the same command with name={free} (or another "
            f"run_dir); to move the trained drafter aside (kept in {self.dirs['checkpoints']}.<its fingerprint>) and "
            f"train these settings in its place, add overwrite=true")

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def run(self) -> dict[str, Any] | None:
        self.refuse_other_trained_settings()
        os.makedirs(self.run_dir, exist_ok=True)
        if self.world_size > 1:
            from dflash.train.engine import init_distributed

            init_distributed()
        stages = list(self.settings.stages)
        if self.rank == 0:
            for warning in self.settings.ignored():
                print(f"dflash: warning: {warning}", file=sys.stderr, flush=True)
        if self.rank == 0 and stages != ["eval"]:  # an evaluation records its config in its own folder
            write_text(os.path.join(self.run_dir, "config.yaml"), OmegaConf.to_yaml(self.cfg, resolve=True))
        if self.rank == 0 and "data" in stages:
            timed("data", self.data)
        if "capture" in stages:
            # Offline capture is split over every rank (after the data stage); the other modes only prepare files.
            if self.world_size > 1 and self.settings.capture.mode == "offline":
                self.barrier()
                timed("capture", self.capture)
            elif self.rank == 0:
                timed("capture", self.capture)
        self.barrier()
        if "train" in stages:
            timed("train", self.train)
        self.barrier()
        summary = None
        if self.rank == 0 and "eval" in stages:
            summary = timed("eval", self.evaluate)
        self.barrier()
        return summary

    # Stages

    def target_identity(self) -> dict:
        return fingerprints.target_identity(self.settings)

    def data_fingerprint(self) -> str:
        return fingerprints.data_fingerprint(self.settings)

    def data(self) -> None:
        from dflash.data.dataset import build_dataset
        from dflash.data.prompts import load_prompts

        d, out = self.settings.data, self.dirs["data"]
        key = self.data_fingerprint()
        if stage_done(out, key):
            print(f"[data] up to date: {out}")
            return
        os.makedirs(out, exist_ok=True)
        prompts = load_prompts(d.source, path=d.path, limit=d.limit, seed=d.seed, turns=d.turns)
        if d.synthetic.count > 0:
            prompts = prompts + self._synthetic_prompts(d.synthetic, out)
        stats = build_dataset(prompts, self.adapter, out, max_length=d.max_length, max_new_tokens=d.max_new_tokens,
                              batch_size=d.batch_size, temperature=d.temperature, top_p=d.top_p, seed=d.seed,
                              show_progress=self.show_progress, heldout=d.heldout, engine=d.engine,
                              compile_step=d.compile_step, refill=d.refill, target=self.target_identity(),
                              before_replace=lambda: clear_done(out))
        print(f"[data] {stats}")
        if stats["failed"]:
            # Not marked done: the next run of this stage retries them (the rest comes from the journal).
            print(f"[data] {stats['failed']} prompt(s) failed (errors above and in stats.json); the stages go on "
                  "without them, and running the data stage again retries them")
            return
        mark_done(out, key, stats=stats)

    def _synthetic_prompts(self, s: Any, out: str) -> list:
        """data.synthetic: prompts the target writes itself (dflash/data/synthetic.py), journaled in the data folder."""
        from dflash.data.synthetic import synthesize_prompts

        d = self.settings.data
        prompts, stats = synthesize_prompts(
            self.adapter, s.count, list(s.system_prompts), os.path.join(out, "synthetic.jsonl"),
            temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens, min_chars=s.min_chars,
            max_oversample=s.max_oversample, keep_system=s.keep_system, batch_size=d.batch_size, seed=d.seed,
            engine=d.engine,
            show_progress=self.show_progress, target=self.target_identity())
        print(f"[data] synthetic prompts: {stats}")
        return prompts

    def capture_fingerprint(self) -> str:
        stats = read_json_or_none(os.path.join(self.dirs["data"], "stats.json")) or {}
        made = {k: stats.get(k) for k in ("fingerprint", "samples", "num_tokens")}
        return fingerprints.capture_fingerprint(self.settings, made)

    def capture(self) -> None:
        from dflash.data.dataset import load_dataset_dir
        from dflash.extract.capture import capture_dataset
        from dflash.train.frozen_head import save_frozen_head

        mode = self.settings.capture.mode
        if mode not in ("offline", "online", "colocated"):
            raise ValueError(f"capture.mode={mode!r}: expected 'offline' (a feature store), 'online' (capture "
                             "workers stream features to the trainer during the train stage) or 'colocated' (each "
                             "trainer rank runs the target itself)")
        out, key = self.dirs["features"], self.capture_fingerprint()
        if self.rank == 0 and not stage_done(out, key):
            # Features of other settings would be refused by the store: moved aside, not lost; those of these
            # settings come back from where an earlier change moved them.
            moved = claim_dir(out, key, stage="capture", contents="features")
            if moved:
                print(f"[capture] features of other settings moved aside to {moved}")
        if mode == "offline":
            self.barrier()  # every rank captures offline (only rank 0 gets here otherwise): wait for the claim
        if stage_done(out, key):
            print(f"[capture] up to date: {out}")
            return
        shape = target_shape(self.adapter)
        config = drafter_config(self.cfg, shape)  # validates taps, mask id and sizes before any work
        dataset = load_dataset_dir(self.dirs["data"])
        c = self.settings.capture
        if mode in ("online", "colocated"):
            # Only what the train stage's capture workers and trainer need: the features are made while training.
            write_json(os.path.join(out, f"{mode}.json"), {
                "data": self.dirs["data"], "num_samples": len(dataset), "target_layer_ids": config.target_layer_ids,
                "dtype": c.dtype, "batch_tokens": c.batch_tokens})
            summary = f"{len(dataset)} samples whose features are made during training ({mode} capture)"
        else:
            from dflash.models.targets.compile_target import target_layers_compiled

            with target_layers_compiled(self.adapter, c.compile):
                manifest = capture_dataset(self.adapter, dataset, out, config.target_layer_ids,
                                           batch_tokens=c.batch_tokens, shard_tokens=c.shard_tokens,
                                           dtype=c.dtype, check_every=c.check_every,
                                           verify_existing=c.verify_existing,
                                           fingerprint={"key": key}, show_progress=self.show_progress,
                                           rank=self.rank, world_size=self.world_size,
                                           pack=c.pack)
            summary = f"{manifest['num_samples']} samples, {manifest['num_tokens']} tokens"
        if self.rank != 0:  # several ranks capture offline; the stage's other files are rank 0's
            self._adapter = None  # frees this rank's device for training (rank 0 keeps the target for eval)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return
        self._capture_heldout(out, config.target_layer_ids)
        save_frozen_head(self.adapter.embed_tokens().weight, self.adapter.lm_head_weight(),
                         os.path.join(out, "frozen_head.safetensors"))
        write_json(os.path.join(out, "target.json"), shape)
        print(f"[capture] {summary} -> {out}")
        mark_done(out, key)

    def _capture_heldout(self, out: str, layer_ids: list[int]) -> None:
        """The held-out samples' target features and greedy tokens, for the acceptance replay during training."""
        from dflash.data.dataset import load_heldout_dir
        from dflash.train.heldout import write_heldout_features

        path = os.path.join(out, "heldout.safetensors")
        rows = load_heldout_dir(self.dirs["data"])
        if rows is None:
            if os.path.exists(path):
                os.remove(path)
            return
        info = write_heldout_features(self.adapter, rows, layer_ids, path,
                                      batch_size=self.settings.train.heldout_batch_size)
        print(f"[capture] held-out: {info['samples']} samples, {info['tokens']} tokens -> {path}")

    def _heldout_set(self):
        """The HeldoutSet of the capture stage, or None when the data stage held nothing out."""
        from dflash.train.heldout import HeldoutSet

        path = os.path.join(self.dirs["features"], "heldout.safetensors")
        if not os.path.exists(path):
            return None
        t = self.settings.train
        return HeldoutSet(path, batch_size=t.heldout_batch_size,
                          max_new_tokens=t.heldout_max_new_tokens or self.settings.data.max_new_tokens)

    def train_settings(self):
        """The train group's checked settings (dflash/config/schema.py)."""
        return self.settings.train

    def checkpoint_fingerprint(self) -> str:
        return fingerprints.checkpoint_fingerprint(self.settings, self.capture_fingerprint())

    def train_fingerprint(self) -> str:
        return fingerprint(self.checkpoint_fingerprint(), self.world_size)

    def train(self) -> None:
        from dflash.eval.export import export_zlab
        from dflash.extract.store import FeatureStore
        from dflash.models.drafter import DFlashDraftModel
        from dflash.train.engine import init_distributed
        from dflash.train.frozen_head import load_frozen_head
        from dflash.train.loop import train
        from dflash.train.metrics_log import MetricsLog

        out, key = self.dirs["export"], self.train_fingerprint()
        if stage_done(out, key):
            if self.rank == 0:
                print(f"[train] up to date: {out}")
            return
        rank, world_size, _ = init_distributed()
        if rank == 0:
            moved = claim_checkpoint_dir(self.dirs["checkpoints"], self.checkpoint_fingerprint())
            if moved:
                print(f"[train] the drafter trained with other settings moved aside to {moved} (overwrite=true)")
            self._carry_trained_outputs(moved)
            write_text(os.path.join(self.dirs["checkpoints"], "config.yaml"), OmegaConf.to_yaml(self.cfg, resolve=True))
            write_json(os.path.join(self.dirs["checkpoints"], SETTINGS_KEY),
                       {"fingerprint": fingerprints.settings_fingerprint(self.settings)})
        self.barrier()
        if stage_done(out, key):  # these settings' drafter came back with their checkpoints
            if rank == 0:
                print(f"[train] restored: {out}")
            return
        shape = read_json(os.path.join(self.dirs["features"], "target.json"))
        config = drafter_config(self.settings, shape)
        logging = self.settings.logging
        log = MetricsLog(self.run_dir, enabled=rank == 0, tensorboard=logging.tensorboard,
                         wandb_mode=str(logging.wandb.mode), wandb_project=str(logging.wandb.project),
                         config=container(self.cfg))
        online = self.settings.capture.mode == "online"
        pools: list = []  # the capture workers this rank started (online, rank 0): always stopped below
        try:
            head = load_frozen_head(os.path.join(self.dirs["features"], "frozen_head.safetensors"))
            settings = self.train_settings()
            lengths = None  # the grouping key of every sample (train.group_by), when batches are grouped
            if settings.group_by_length:  # from the token dataset: reading it costs nothing, unlike a store
                from dflash.data.dataset import load_dataset_dir
                from dflash.data.batch_plan import grouping_keys

                lengths = tuple(grouping_keys(load_dataset_dir(self.dirs["data"]), settings.group_by,
                                              settings.num_anchors, config.block_size).tolist())
            if online:
                from dflash.train.online_capture import OnlineCapture

                online_capture = OnlineCapture(self.cfg, self.run_dir, self.dirs, self.device, self.barrier)
                store = online_capture.source(settings, rank, world_size, pools, lengths)
            elif self.settings.capture.mode == "colocated":
                store = self._colocated_source()
            else:
                store = FeatureStore(self.dirs["features"])
            started = time.perf_counter()
            with self._colocated_target_compiled():
                state = train(settings, config, store, head, self.dirs["checkpoints"], log,
                              deepspeed=self.settings.deepspeed, rank=rank,
                              world_size=world_size, device=self.device, show_progress=self.show_progress,
                              heldout=self._heldout_set(), lengths=lengths)
            if online and rank == 0:
                online_capture.finish(store, pools[0] if pools else None, time.perf_counter() - started, world_size)
        finally:
            for pool in pools:
                pool.kill()
            log.close()
        if rank == 0:
            drafter = DFlashDraftModel(config)
            drafter.load_state_dict({k: v.float() for k, v in state.items()})
            export_zlab(drafter, out)
            self._export_best(config)
            self._plot_training_curve()
            # The settings of the checkpoints behind this export: the eval stage checks them (world size aside).
            mark_done(out, key, checkpoint=self.checkpoint_fingerprint())
            print(f"[train] exported drafter -> {out}")

    def _carry_trained_outputs(self, moved: str | None) -> None:
        """A training's outputs travel with its checkpoints: into the folder the other settings' checkpoints were
        moved to, and back out of restored ones, so that each run's exports and metrics stay its own (the trainer
        then drops only the records after the step it resumes from, MetricsLog.resume_from)."""
        for name in TRAINED_OUTPUTS:
            current = os.path.join(self.run_dir, name)
            if moved and os.path.exists(current):
                os.replace(current, os.path.join(moved, name))
            restored = os.path.join(self.dirs["checkpoints"], name)
            if os.path.exists(restored) and not os.path.exists(current):
                os.replace(restored, current)

    def _colocated_target_compiled(self):
        """capture.compile with colocated capture: the target's layers compiled for training, eager for eval."""
        from dflash.models.targets.compile_target import target_layers_compiled

        c = self.settings.capture
        if c.mode != "colocated" or not c.compile:
            return contextlib.nullcontext()
        return target_layers_compiled(self.adapter)

    def _colocated_source(self):
        """This rank's ColocatedFeatureSource: the target on this rank's device makes each micro-batch's features."""
        from dflash.data.dataset import load_dataset_dir
        from dflash.extract.colocated import ColocatedFeatureSource

        info = read_json(os.path.join(self.dirs["features"], "colocated.json"))
        return ColocatedFeatureSource(self.adapter, load_dataset_dir(info["data"]), info["target_layer_ids"],
                                      info["dtype"], final_hidden=self.settings.train.kl_weight > 0)

    def _plot_training_curve(self) -> None:
        from dflash.train.curve_plot import plot_training_curve

        metrics = os.path.join(self.run_dir, "metrics.jsonl")
        if os.path.exists(metrics):
            path = plot_training_curve(metrics, os.path.join(self.run_dir, "training_curve.png"))
            print(f"[train] training curve -> {path}")

    def _export_best(self, config) -> dict[str, Any] | None:
        """export_best/: the checkpoint with the best held-out tau, in the z-lab format (removed when none); returns
        its best.json (step, tau, acceptance rate), or None."""
        from dflash.eval.export import export_zlab
        from dflash.models.drafter import DFlashDraftModel
        from dflash.train.best_checkpoint import best_state_dict, read_best

        folder = os.path.join(self.run_dir, "export_best")
        exported = read_json_or_none(os.path.join(folder, "best.json"))  # written last: the export is whole
        if exported is not None and exported == read_best(self.dirs["checkpoints"]):
            return exported  # this best checkpoint is exported already (an eval of a stopped run, rerun)
        best = best_state_dict(self.dirs["checkpoints"])
        if best is None:
            shutil.rmtree(folder, ignore_errors=True)
            return None
        drafter = DFlashDraftModel(config)
        drafter.load_state_dict({k: v.float() for k, v in best[0].items()})
        export_zlab(drafter, folder)
        write_json(os.path.join(folder, "best.json"), best[1])
        print(f"[train] best held-out checkpoint (step {best[1]['step']}, tau {best[1]['tau']:.3f}) -> {folder}")
        return best[1]

    def eval_drafter_dir(self) -> str:
        """export_best/ (the best held-out tau) when eval.checkpoint is 'best' and training kept one, else export/."""
        choice = self.settings.eval.checkpoint
        best = os.path.join(self.run_dir, "export_best")
        if choice == "best" and os.path.exists(os.path.join(best, "best.json")):
            return best
        return self.dirs["export"]

    def _drafter_to_evaluate(self) -> tuple[str, str]:
        """(folder, fingerprint) of the drafter the eval stage measures. A run whose training stopped early (a time
        limit, a signal) has no export of its settings yet; with eval.checkpoint=best its best held-out checkpoint
        so far is exported and measured, so a stopped run can be evaluated without resuming it."""
        folder, done = self.eval_drafter_dir(), os.path.join(self.dirs["export"], "done.json")
        current = self.checkpoint_fingerprint()
        marker = read_json_or_none(done)
        # A marker without the field predates it and is trusted as before.
        if marker is not None and marker.get("checkpoint", current) == current:
            return folder, marker["fingerprint"]
        owner = read_json_or_none(os.path.join(self.dirs["checkpoints"], CHECKPOINT_KEY)) or {}
        best = None
        if self.settings.eval.checkpoint == "best" and owner.get("fingerprint") == current:
            best = self._export_best(drafter_config(self.settings, read_json(os.path.join(self.dirs["features"],
                                                                                     "target.json"))))
        if best is None:
            raise NothingToEvaluate(
                f"no drafter of these settings to evaluate: the train stage has not finished ({done} is "
                f"{'missing' if marker is None else 'from other settings'}) and {self.dirs['checkpoints']} holds no "
                f"best held-out checkpoint of these settings (data.heldout > 0 and eval.checkpoint=best make one); "
                f"rerun training, which resumes from its last checkpoint"
            )
        print(f"[eval] training has not finished: evaluating its best held-out checkpoint so far "
              f"(step {best['step']}, held-out tau {best['tau']:.3f})")
        return os.path.join(self.run_dir, "export_best"), fingerprint(current, best)

    def evaluate(self) -> dict[str, Any]:
        from dflash.eval.evaluate import evaluate, format_table, load_prompt_sets, write_summary
        from dflash.eval.export import load_drafter
        from dflash.eval.metrics import PhaseTimer

        out = self.dirs["eval"]
        folder, drafter_key = self._drafter_to_evaluate()
        key = fingerprints.eval_fingerprint(self.settings, drafter_key, folder)
        summary_path = os.path.join(out, "summary.json")
        if stage_done(out, key) and os.path.exists(summary_path):
            summary = read_json(summary_path)
        else:
            os.makedirs(out, exist_ok=True)
            clear_done(out)
            e = self.settings.eval
            print(f"[eval] drafter {folder}")
            drafter = load_drafter(folder, dtype=self.adapter.dtype, device=str(self.device))
            template_kwargs = dict(e.chat_template_kwargs)
            timer = PhaseTimer(self.adapter.device)  # summary["timing"]: where the eval's minutes go
            prompt_sets, categories = load_prompt_sets(
                self.adapter, prompt_set_specs(e), max_new_tokens=e.max_new_tokens, template_kwargs=template_kwargs,
                batch_size=e.batch_size, timer=timer,
            )
            summary = evaluate(drafter, self.adapter, prompt_sets, max_new_tokens=e.max_new_tokens,
                               show_progress=self.show_progress, mode=e.mode, temperature=e.temperature,
                               seed=e.seed, measure_target=e.measure_target, categories=categories,
                               batch_size=e.batch_size, timer=timer, live_engine=e.live_engine,
                               draft_sampling=e.draft_sampling)
            summary["chat_template_kwargs"] = template_kwargs
            write_summary(summary, out)
            write_text(os.path.join(out, "config.yaml"), OmegaConf.to_yaml(self.cfg, resolve=True))
            mark_done(out, key)
        print(format_table(summary))
        return summary

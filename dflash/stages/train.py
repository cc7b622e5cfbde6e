"""The train stage: the drafter trained under DeepSpeed on every rank from the capture stage's features, its
checkpoints in `checkpoints/`, and at the end its final weights, consolidated, in `checkpoints/final/` (what the
export stage, dflash/stages/export.py, reads). Its done.json is `checkpoints/done.json`.

Its checkpoints belong to one set of settings (their fingerprint in checkpoints/fingerprint.json). Checkpoints of
other settings reach this stage only with overwrite=true (dflash/stages/guard.py): they are moved aside with what
their training left in the run folder and the evaluations of their drafter there, never deleted, and come back when
those settings return. With overwrite=true the data stage moves them aside the same way when it replaces the data
they were trained on (set_drafter_aside).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shlex
import shutil
import time
from typing import TYPE_CHECKING, Any

from dflash.config import ConfigError, fingerprints
from dflash.config.command_line import hydra_overrides
from dflash.config.errors import RunFolderError
from dflash.config.training_command import training_overrides
from dflash.run_files import CHECKPOINT_KEY, SETTINGS_KEY, checksum_problem, claim_checkpoint_dir, claimed_key, \
    container, fingerprint, from_rank0, read_json, read_json_or_none, stage_done, write_json, write_text
from dflash.stages.batch_split import counted_ranks, fingerprinted, keeping_batch, recorded_split, settings_record, \
    split_record
from dflash.stages.capture import CaptureStage
from dflash.stages.context import RunContext
from dflash.stages.shapes import drafter_config
from dflash.stages.stage import Stage

if TYPE_CHECKING:
    from dflash.config.schema import RunSettings
    from dflash.extract.feature_memory import FeatureMemory

logger = logging.getLogger(__name__)

# What a training leaves in the run folder beside its checkpoints: its logs (metrics_log.py), exports, curve and the
# evaluation of its export. They travel with the checkpoints when those are moved aside (overwrite=true) or back, as
# do the other evaluation folders of its drafter in the run folder (eval_folders).
TRAINED_OUTPUTS = ("metrics.jsonl", "tensorboard", "wandb", "export", "export_best", "training_curve.png", "eval")


class TrainStage(Stage):
    name = "train"
    made = "trained"
    every_rank = True

    def __init__(self, run: RunContext, capture: CaptureStage) -> None:
        self.context, self.capture = run, capture
        self.input_stage = capture
        self.checkpoints = self.out = run.dirs["checkpoints"]
        self.link = None  # this trainer rank's link to the capture ranks (capture=online), set by run_role

    def describe(self) -> str:
        s = self.context.settings
        t, d = s.train, s.drafter
        length = f"{t.max_minutes} minutes" if t.max_minutes else f"{t.epochs} epochs" + (
            f" (at most {t.max_steps} steps)" if t.max_steps else "")
        batch = f"{t.micro_batch_size} sequences x {self.context.world_size} rank(s) x {t.grad_accum}"
        return (f"a {d.num_hidden_layers}-layer drafter (block {d.block_size}) for {length}, {batch} per step, "
                f"{t.num_anchors} anchors each, lr {t.lr}, ZeRO-{s.deepspeed.zero_stage}")

    @functools.cached_property
    def fingerprinted_settings(self) -> RunSettings:
        """The settings this stage and the stages after it are fingerprinted with: this command's, with the split
        of the run folder's training where this launch splits the same global batch otherwise (batch_split.py).
        A command that trains nothing is taken at the rank count of the last launch that trained."""
        run = self.context
        recorded = recorded_split(self.checkpoints)
        if recorded is None:
            return run.settings
        candidate = fingerprinted(run.settings, recorded, counted_ranks(run.settings, run.world_size, recorded))
        if candidate is run.settings:
            return candidate
        # Only where the training there is of these settings under the recorded split: another training's split
        # would key these settings' own checkpoints, moved aside, otherwise than they were.
        trained = settings_record(self.checkpoints).get("fingerprint")
        if trained is not None:
            same = trained == fingerprints.settings_fingerprint(candidate)
        else:
            same = claimed_key(self.checkpoints) == fingerprints.checkpoint_fingerprint(candidate,
                                                                                        self.capture.fingerprint())
        return candidate if same else run.settings

    def warnings(self) -> list[str]:
        """train.devices, which only the launch scripts read (a trainer rank per GPU), where the command was started
        without one (one process, no CUDA_VISIBLE_DEVICES, which the scripts always set): it trains alone, on one
        device, with one rank's batch."""
        t, world_size = self.context.settings.train, self.context.world_size
        if world_size > 1 or "CUDA_VISIBLE_DEVICES" in os.environ or t.devices is None or len(t.devices) < 2:
            return []
        batch = t.micro_batch_size * t.grad_accum
        return [f"train.devices={list(t.devices)} places one trainer rank per GPU only under launch/one_node.sh or "
                f"launch/multi_node.sh (docs/distributed.md): this command runs as one process on one device, with a "
                f"global batch of {batch} sequences, not {batch * len(t.devices)}"]

    def checkpoint_fingerprint(self) -> str:
        """What the checkpoints depend on: not the rank count (a run resumes on another, converting them), nor how
        the global batch is split (batch_split.py)."""
        return fingerprints.checkpoint_fingerprint(self.fingerprinted_settings, self.capture.fingerprint())

    def settings_fingerprint(self) -> str:
        """The checkpoint fingerprint less what the data stage made (fingerprints.settings_fingerprint)."""
        return fingerprints.settings_fingerprint(self.fingerprinted_settings)

    def fingerprint(self) -> str:
        """The checkpoint fingerprint and the rank count; for a training of these settings finished on another rank
        count, the one it finished with: a rerun on other ranks keeps that drafter instead of resuming it in
        another global batch (which resume_tag refuses)."""
        return self.finished_fingerprint() or self.launch_fingerprint()

    def launch_fingerprint(self) -> str:
        return fingerprint(self.checkpoint_fingerprint(), self.context.world_size)

    def finished_fingerprint(self) -> str | None:
        """The done marker's fingerprint where a training of these settings finished (on any rank count), else
        None."""
        done = read_json_or_none(os.path.join(self.out, "done.json"))
        if isinstance(done, dict) and done.get("checkpoint") == self.checkpoint_fingerprint() \
                and isinstance(done.get("fingerprint"), str):
            return done["fingerprint"]
        return None

    def done(self) -> bool:
        """Marked done for these settings: in checkpoints/, or (a run folder where training and export were one
        stage, which prepare() adopts) in export/."""
        return super().done() or stage_done(self.context.dirs["export"], self.fingerprint())

    def preflight(self, selected: bool) -> None:
        """Any command: the run folder must not hold a drafter of other settings (dflash/stages/guard.py). Selected:
        features finished for these settings unless the command captures (refuse_unfinished_input), the logger
        packages the logging settings name must be installed, and wandb online needs its API key."""
        from dflash.stages.guard import refuse_other_trained_settings

        refuse_other_trained_settings(self)
        self.refuse_unfinished_input(selected)
        if selected:
            self.refuse_other_global_batch()
            from dflash.train.metrics_log import missing_logger_package, missing_wandb_credentials

            logging_settings = self.context.settings.logging
            # A training finished for these settings starts no logger: the credentials matter only to one that runs.
            missing = missing_logger_package(logging_settings.tensorboard, logging_settings.wandb.mode) or \
                (None if self.done() else missing_wandb_credentials(logging_settings.wandb.mode))
            if missing:
                raise ConfigError(missing)

    def refuse_other_global_batch(self) -> None:
        """RunFolderError before any work when checkpoints/ holds an unfinished training of these settings whose
        last checkpoint counts steps in another global batch than this launch's (it was trained on another rank
        count): its data position would not match, so it resumes only on the ranks it was trained with."""
        from dflash.train.checkpoints import complete_tags, saved_layout

        if self.finished_fingerprint() or claimed_key(self.checkpoints) != self.checkpoint_fingerprint():
            return  # kept as it is, or another training's checkpoints, which the claim moves aside
        tags = complete_tags(self.checkpoints)  # the newest is what a resume loads, unless it fails to verify
        tag = tags[-1][1] if tags else None
        layout = saved_layout(self.checkpoints, tag) if tag is not None else {}
        t, ranks = self.context.settings.train, self.context.world_size
        now, saved = t.micro_batch_size * ranks * t.grad_accum, layout.get("global_batch_size")
        if saved is not None and saved != now:
            keeping = keeping_batch(saved, t.micro_batch_size, ranks, t.grad_accum)
            way = f"add {keeping} to resume it on these {ranks} rank(s)" if keeping else \
                f"resume it with a train.micro_batch_size x ranks x train.grad_accum of {saved}"
            raise RunFolderError(
                f"{os.path.join(self.checkpoints, tag)} was trained on {layout.get('world_size', '?')} rank(s) with a "
                f"global batch of {saved} samples; this launch of {ranks} rank(s) has {now} (train.micro_batch_size "
                f"x ranks x train.grad_accum): {way} (the same training, docs/distributed.md), or train in another "
                f"run_dir")

    def prepare(self) -> None:
        if self.context.rank == 0:
            self.adopt_earlier_marker()
            # Outputs a kill stranded inside checkpoints/ (after claim_checkpoints put them there or restored them
            # with it, before they moved on): back where the up-to-date check and the later stages look.
            bring_out_trained_outputs(self.context.run_dir, self.checkpoints)

    def up_to_date(self) -> bool:
        """Marked done for these settings, with whole final weights. Weights missing or corrupt are named: training
        resumes at its last checkpoint and writes them from it; without a checkpoint they are written from this
        training's whole export; with neither, RunFolderError (training again would start from step 0 and replace
        the run's best checkpoint and metrics)."""
        from dflash.train.checkpoints import complete_tags
        from dflash.train.final_weights import final_problem

        if not stage_done(self.out, self.fingerprint()):
            return False
        problem = final_problem(self.checkpoints)
        if problem is None:
            return True
        if complete_tags(self.checkpoints):
            logger.warning(f"[train] warning: {problem}; training resumes at its last checkpoint and writes them")
            return False
        if self.final_from_export():
            logger.warning(f"[train] warning: {problem}; written again from {self.context.dirs['export']}")
            return True
        raise RunFolderError(
            f"{problem}, and no checkpoint of this finished training is left to write them from: training again "
            f"would start from step 0 and replace its best checkpoint and metrics. Restore them, or move "
            f"{self.checkpoints} aside to train again")

    def kept(self) -> None:
        resplit = self.resplit_line() if self.context.rank == 0 else None
        if resplit:
            logger.info(f"[train] kept: {resplit}")
        elif self.context.rank == 0 and self.fingerprint() != self.launch_fingerprint():
            logger.info(f"[train] kept: these settings' drafter was trained on another number of ranks than this "
                        f"launch's {self.context.world_size}")

    def resplit_line(self) -> str | None:
        """What this launch's split of the global batch is to the run folder's training, where it splits it
        otherwise (batch_split.py), else None."""
        t, trained = self.context.settings.train, self.fingerprinted_settings.train
        recorded = settings_record(self.checkpoints).get("fingerprint")
        if trained is t or recorded != self.settings_fingerprint():
            return None
        ranks = self.context.world_size
        return (f"train.micro_batch_size={t.micro_batch_size} x {ranks} rank(s) x train.grad_accum={t.grad_accum} "
                f"is the global batch of {t.micro_batch_size * ranks * t.grad_accum} that this run folder's training "
                f"was started with as train.micro_batch_size={trained.micro_batch_size} and train.grad_accum="
                f"{trained.grad_accum}: the same training")

    def run(self) -> dict[str, Any] | None:
        """Training on this rank, resumed from its last checkpoint when there is one; rank 0 writes the final
        weights. The settings of the checkpoints behind them go into done.json: the export carries them to the eval
        stage, which checks them (world size aside). None when these settings' drafter came back with their
        checkpoints (already done)."""
        from dflash.train.engine import init_distributed
        from dflash.train.final_weights import final_dir, write_final

        run = self.context
        rank, _, _ = init_distributed()
        from_rank0(self.check_changed_mask_token, "whether the mask token is free")
        resplit = self.resplit_line() if rank == 0 else None  # before the claim rewrites settings.json
        if from_rank0(self.claim_checkpoints, f"{self.checkpoints} (claiming it for these settings)"):
            if rank == 0:
                logger.info(f"[train] restored: {self.out}")
            return None
        if resplit:
            logger.info(f"[train] {resplit}, resumed")
        config = self.drafter_config()
        state = self.train(config, rank, run.world_size)
        if rank == 0:
            from dflash.train.metrics_log import closing_records, ending_line

            write_final(self.checkpoints, state)
            closing = closing_records(run.run_dir)
            if closing:
                logger.info(ending_line(closing))
            logger.info(f"[train] final weights -> {final_dir(self.checkpoints)}")
        return {"checkpoint": self.checkpoint_fingerprint()}

    def check_changed_mask_token(self) -> None:
        """Rank 0. A target.mask_token_id given after the features were captured (it changes the drafter, not the
        features, so capture is kept) is checked as capture checks it, against the chat template and the data,
        before any step trains on it: with the target under colocated capture (it captures), else with its
        tokenizer and vocabulary alone (no weight is read)."""
        from dflash.data.dataset import load_dataset_dir
        from dflash.models.targets.load import load_target_vocabulary

        s = self.context.settings
        given = s.target.mask_token_id
        recorded = read_json_or_none(os.path.join(self.capture.out, "target.json")) or {}
        if given is None or given == recorded.get("mask_token_id"):
            return
        t = s.target
        adapter = None if s.capture.mode == "colocated" else load_target_vocabulary(
            t.kind, path=t.path, tiny=t.tiny, cache_dir=t.cache_dir, chat_template=t.chat_template)
        self.capture.mask_token(load_dataset_dir(self.capture.data.out), adapter)

    def adopt_earlier_marker(self) -> None:
        """Rank 0. A run folder whose export/done.json holds this stage's fingerprint and which has no
        checkpoints/done.json was trained and exported by one stage: its final weights are only in export/. They
        are copied to checkpoints/final/ (in the export's dtype, from which an export is the same bytes), then the
        marker to checkpoints/done.json, last, so the stage is done there without training again. An export that
        differs from its checksums is not copied: the stage runs and writes the weights from its last checkpoint."""
        export = self.context.dirs["export"]
        if os.path.exists(os.path.join(self.out, "done.json")) or not self.final_from_export():
            return
        write_json(os.path.join(self.out, "done.json"), read_json(os.path.join(export, "done.json")))
        logger.info(f"[train] final weights and done marker copied from {export} to {self.out}")

    def final_from_export(self) -> bool:
        """Rank 0. checkpoints/final/ written from export/ (in the export's dtype, from which an export is the same
        bytes) when the export is whole and marked done for this stage's fingerprint; whether it was."""
        from safetensors.torch import load_file

        from dflash.eval.export import WEIGHTS_NAME
        from dflash.train.final_weights import write_final

        export = self.context.dirs["export"]
        if not stage_done(export, self.fingerprint()) or checksum_problem(export) is not None:
            return False
        write_final(self.checkpoints, load_file(os.path.join(export, WEIGHTS_NAME)))
        return True

    def drafter_config(self):
        """The drafter's DrafterConfig: the settings, with the target's shape, taps and final logit transform as the
        capture stage recorded them. ConfigError when its features were taken at other layers than these settings'
        taps."""
        from dflash.train.frozen_head import load_logit_transform

        shape = os.path.join(self.capture.out, "target.json")
        if not os.path.isfile(shape):  # features/ deleted to free disk: a trained drafter still needs its record
            from dflash.stages.evaluation import command_overrides

            command = shlex.join(["python", "-m", "dflash.extract",
                                  *command_overrides(self.context.settings, True, True)])
            raise RunFolderError(f"{shape} is missing: the drafter's shape and taps come from the capture stage's "
                                 f"record of the target; capture again ({command}), which rewrites it")
        config = drafter_config(self.context.settings, read_json(shape))
        captured = self.capture.layer_ids()
        if captured is not None and captured != config.target_layer_ids:
            taps = ",".join(str(i) for i in captured)
            raise ConfigError(
                f"the features in {self.capture.out} were captured at target layers {captured}, these settings' "
                f"taps are {config.target_layer_ids} (drafter.target_layer_ids, drafter.num_taps): run the capture "
                f"stage again (stages=[capture,train]) or set drafter.target_layer_ids=[{taps}]")
        # The transform the training loss applies, so that the export writes it for the serving engines.
        return config.with_logit_transform(load_logit_transform(os.path.join(self.capture.out,
                                                                             "frozen_head.safetensors")))

    def claim_checkpoints(self) -> bool:
        """checkpoints/ made this training's (rank 0): those of other settings moved aside with their outputs.
        Whether that brought back the trained drafter of these settings (moved aside earlier): then nothing is
        left to train."""
        run = self.context
        marked = stage_done(self.out, self.fingerprint())  # and yet run: the final weights are missing or corrupt
        orphaned = outputs_key(run)
        recorded = settings_record(self.checkpoints).get("fingerprint")
        # The outputs go into checkpoints/ before it is moved aside, so that one rename moves a drafter with them:
        # a kill never leaves one drafter's outputs in the run folder beside another's checkpoints.
        moved = claim_checkpoint_dir(self.checkpoints, self.checkpoint_fingerprint(),
                                     before_move=lambda drafter: carry_trained_outputs_into(
                                         run.run_dir, self.checkpoints, drafter))
        if moved is None and orphaned not in (None, self.checkpoint_fingerprint()):
            moved = outputs_aside(self.checkpoints, orphaned)
        carry_trained_outputs(run.run_dir, self.checkpoints, moved)
        if moved and removed_if_untrained(moved):
            logger.info(f"[train] removed {moved}: the settings of a training that saved and logged no step")
        elif moved:
            logger.info(f"[train] {self.moved_line(moved, recorded)}")
        write_text(os.path.join(self.checkpoints, "config.yaml"), run.config_yaml())
        earlier = settings_record(self.checkpoints)
        record = {"fingerprint": self.settings_fingerprint(),
                  "split": split_record(self.fingerprinted_settings, run.settings, run.world_size)}
        taps = self.capture.layer_ids()
        if taps is not None:  # what an automatic drafter.target_layer_ids chose, for a later refusal to name
            record["target_layer_ids"] = taps
        # What `python -m dflash.eval` adopts (dflash/config/training_command.py); a launch outside a Hydra command
        # (a notebook, a test) keeps the one recorded before.
        command = training_overrides(hydra_overrides(run.settings))
        command = earlier.get("command") if command is None else command
        if command is not None:
            record["command"] = command
        write_json(os.path.join(self.checkpoints, SETTINGS_KEY), record)
        self.adopt_earlier_marker()  # a drafter brought back from a folder of the earlier layout
        return not marked and self.up_to_date()

    def moved_line(self, moved: str, recorded: str | None) -> str:
        """The log line of claim_checkpoints for the checkpoints it moved aside to `moved`: what they were (by
        `recorded`, the settings fingerprint they recorded) and why they went."""
        same = recorded == self.settings_fingerprint()
        if self.context.settings.overwrite:
            what = "the drafter trained with these settings on other data" if same else \
                "the drafter trained with other settings"
            return f"{what} moved aside to {moved} (overwrite=true)"
        if same:  # the run-folder guard lets these settings through: the data stage's output changed under them
            return (f"the drafter trained with these settings moved aside to {moved}: the data stage's output changed "
                    f"under them since (failed prompts answered on a rerun, or data/ built again), and they train on "
                    f"it now")
        # Otherwise the guard found no finished drafter to refuse for.
        return f"the checkpoints of an unfinished training of other settings moved aside to {moved}"

    def train(self, config, rank: int, world_size: int) -> dict:
        """The training loop on this rank, fed by the capture mode's feature source; the final state dict."""
        from dflash.train.frozen_head import load_frozen_head, load_logit_transform
        from dflash.train.loop import train
        from dflash.train.metrics_log import MetricsLog

        run, settings = self.context, self.context.settings
        logging = settings.logging
        log = MetricsLog(run.run_dir, enabled=rank == 0, tensorboard=logging.tensorboard,
                         wandb_mode=logging.wandb.mode, wandb_project=logging.wandb.project,
                         config=container(run.cfg))
        colocated = None
        try:
            head_file = os.path.join(self.capture.out, "frozen_head.safetensors")
            head = load_frozen_head(head_file)
            lengths = self.grouping_keys(config.block_size)
            online = None
            if settings.capture.mode == "online":
                from dflash.train.rank_capture import RankCapture

                online = RankCapture(self.link, settings.capture, self.capture.out, self.checkpoints, run.run_dir,
                                     data=self.capture.data.out)
                store = online.source(settings.train, rank, world_size, lengths)
            elif settings.capture.mode == "colocated":
                store = colocated = self.colocated_source()
            else:
                from dflash.extract.store import FeatureStore

                store = FeatureStore(self.capture.out)
            started = time.perf_counter()
            with self.colocated_target_compiled():
                state = train(settings.train, config, store, head, self.checkpoints, log,
                              deepspeed=settings.deepspeed, rank=rank, world_size=world_size, device=run.device,
                              show_progress=run.show_progress, heldout=self.heldout_set(), lengths=lengths,
                              logit_transform=load_logit_transform(head_file))
            if online is not None:
                online.finish(store, time.perf_counter() - started, rank, world_size)
            elif colocated is not None and rank == 0:
                logger.info(colocated.summary())
            if run.device.type == "cuda" and rank == 0:
                import torch

                logger.info(f"[train] peak GPU memory {torch.cuda.max_memory_allocated(run.device) / 2**30:.1f} GiB "
                            "(allocated by torch on this rank's GPU)")
        finally:
            if colocated is not None:
                colocated.close()  # the kept features' host memory, before export and eval run in this process
            log.close()
        return state

    def grouping_keys(self, block_size: int) -> tuple[int, ...] | None:
        """Every sample's grouping key (train.group_by) when batches are grouped, from the token dataset (reading
        it costs nothing, unlike a feature store); else None."""
        if not self.context.settings.train.group_by_length:
            return None
        from dflash.data.batch_plan import plan_lengths
        from dflash.data.dataset import load_dataset_dir

        return plan_lengths(load_dataset_dir(self.capture.data.out), self.context.settings.train, block_size)

    def heldout_set(self):
        """The HeldoutSet of the capture stage, or None when the data stage held nothing out."""
        from dflash.config.schema import best_by_temperature
        from dflash.train.heldout import HeldoutSet, sampled_path

        path = os.path.join(self.capture.out, "heldout.safetensors")
        if not os.path.exists(path):
            return None
        settings = self.context.settings
        sizes = dict(batch_size=settings.train.heldout_batch_size,
                     max_new_tokens=settings.train.heldout_max_new_tokens or settings.data.max_new_tokens)
        # train.best_by=tau_T<x>: the estimate runs on the held-out prompts continued at x (capture writes them).
        temperature = best_by_temperature(settings.train.best_by)
        sampled = sampled_path(path, temperature) if temperature else None
        estimate_from = HeldoutSet(sampled, **sizes) if sampled and os.path.exists(sampled) else None
        return HeldoutSet(path, path_temperature=settings.data.temperature, estimate_from=estimate_from, **sizes)

    def colocated_target_compiled(self):
        """capture.compile with colocated capture: the target's layers compiled for training, eager for eval."""
        from dflash.models.targets.compile_target import target_layers_compiled

        c = self.context.settings.capture
        if c.mode != "colocated" or not c.compile:
            return contextlib.nullcontext()
        return target_layers_compiled(self.context.target)

    def colocated_source(self):
        """This rank's ColocatedFeatureSource: the target on this rank's device makes each micro-batch's features
        from this run folder's data (not a "data" path in colocated.json: it is stale once the folder moved)."""
        from dflash.data.dataset import load_dataset_dir
        from dflash.data.sample_sizes import sample_lengths
        from dflash.extract.colocated import ColocatedFeatureSource

        info = read_json(os.path.join(self.capture.out, "colocated.json"))
        t = self.context.settings.train
        # The KL loss and the target's labels both read the target's final hidden states.
        final_hidden = t.kl_weight > 0 or t.labels == "target"
        dataset = load_dataset_dir(self.capture.data.out)
        lengths = sample_lengths(dataset)  # every sample's tokens: the static buffers and the memory are sized by them
        static = None
        if getattr(self.context.settings.capture, "cuda_graphs", False):
            from dflash.extract.static_capture import StaticCapture

            target = self.context.target
            static = StaticCapture(target, info["target_layer_ids"], final_hidden,
                                   max_width=int(lengths.max()),
                                   pad_id=target.tokenizer.pad_token_id)
        return ColocatedFeatureSource(self.context.target, dataset, info["target_layer_ids"], info["dtype"],
                                      final_hidden=final_hidden, static=static,
                                      memory=self.colocated_memory(dataset, lengths, info, final_hidden),
                                      lengths=lengths, check_every=self.context.settings.capture.check_every)

    def colocated_memory(self, dataset: Any, lengths: Any, info: dict, final_hidden: bool) -> FeatureMemory | None:
        """capture.cache: the FeatureMemory keeping the first epoch's colocated features for the later epochs
        (dflash/extract/feature_memory.py), or None; sized from the samples' token counts (`lengths`) and the taps,
        for the epochs left from the newest checkpoint."""
        from dflash.data.batch_plan import BatchPlan
        from dflash.extract.feature_memory import choose_feature_memory
        from dflash.extract.store import store_dtype
        from dflash.train.checkpoints import complete_tags
        from dflash.train.feature_cache_choice import cache_mode
        from dflash.train.loop import count_steps

        run, capture, t = self.context, self.context.settings.capture, self.context.settings.train
        target = run.target
        plan = BatchPlan(len(dataset), t.micro_batch_size, run.world_size, t.grad_accum, t.seed)
        saved = complete_tags(self.checkpoints)  # (step, tag), oldest first: the newest is where training resumes
        first_epoch = (saved[-1][0] if saved else 0) // plan.steps_per_epoch
        epochs = -(-count_steps(t, plan) // plan.steps_per_epoch) - first_epoch  # those left to run
        widths = {"hidden": (len(info["target_layer_ids"]) * target.hidden_size, store_dtype(info["dtype"]))}
        if final_hidden:
            widths["target_final"] = (target.hidden_size, target.dtype)
        return choose_feature_memory(cache_mode(capture.cache), capture.cache_budget_bytes, tokens=int(lengths.sum()),
                                     longest=int(lengths.max()), widths=widths, epochs=epochs,
                                     world_size=run.world_size, pin_memory=run.device.type == "cuda",
                                     samples=len(lengths))


def set_drafter_aside(run: RunContext) -> str | None:
    """Rank 0: the training in the run folder (its checkpoints, finished or not, or the outputs of one whose
    checkpoints are gone) moved aside with its outputs to checkpoints.<its checkpoint fingerprint>, where
    claim_checkpoints moves a drafter of other settings and brings it back from when they return. Where it went, or
    None when there was none."""
    checkpoints, orphaned = run.dirs["checkpoints"], outputs_key(run)
    if os.path.isdir(checkpoints) and os.listdir(checkpoints):
        moved = f"{checkpoints}.{claimed_key(checkpoints) or 'unfingerprinted'}"
        os.replace(checkpoints, moved)
    elif orphaned is not None:
        moved = outputs_aside(checkpoints, orphaned)
    else:
        return None
    carry_trained_outputs(run.run_dir, checkpoints, moved)
    return None if removed_if_untrained(moved) else moved


def outputs_key(run: RunContext) -> str | None:
    """When checkpoints/ holds nothing: the checkpoint fingerprint of the training whose outputs are in the run
    folder all the same (its export's done.json; "unfingerprinted" without one). None when checkpoints/ holds
    something (its own marker names it) or there are no such outputs."""
    checkpoints = run.dirs["checkpoints"]
    if os.path.isdir(checkpoints) and os.listdir(checkpoints):
        return None
    if not any(os.path.exists(os.path.join(run.run_dir, name)) for name in TRAINED_OUTPUTS):
        return None
    done = read_json_or_none(os.path.join(run.dirs["export"], "done.json"))
    key = done.get("checkpoint") if isinstance(done, dict) else None
    return key or "unfingerprinted"


def removed_if_untrained(moved: str) -> bool:
    """Remove the checkpoints folder `moved` aside when it holds only what a training writes before its first step
    (one that failed there, after an overwrite=true had moved the trained drafter aside): its settings records
    (claim_checkpoints), an empty metrics.jsonl and, with it, the wandb run the logger opened before the failure
    (wandb/, which logged no step then); no checkpoint, log, export or evaluation, and no file of anyone else's.
    Every such failure would leave one more folder. Whether it did."""
    records = {CHECKPOINT_KEY, SETTINGS_KEY, "config.yaml"}
    log = os.path.join(moved, "metrics.jsonl")
    no_step = not os.path.exists(log) or (os.path.isfile(log) and os.path.getsize(log) == 0)
    for name in os.listdir(moved):
        path = os.path.join(moved, name)
        empty_log = name == "metrics.jsonl" and no_step
        if not (name in records and os.path.isfile(path)) and not empty_log and not (name == "wandb" and no_step):
            return False
    shutil.rmtree(moved)
    return True


def outputs_aside(checkpoints: str, key: str) -> str:
    """Where the outputs of a training whose checkpoints are gone go aside: where a folder of its checkpoints would
    be (claim_dir brings it back with them when its settings return), made now."""
    moved = f"{checkpoints}.{key}"
    os.makedirs(moved, exist_ok=True)
    return moved


def carry_trained_outputs(run_dir: str, checkpoints: str, moved: str | None) -> None:
    """A training's outputs and the evaluations of its drafter travel with its checkpoints: into the folder the
    other settings' checkpoints were moved to (claim_checkpoints puts them into checkpoints/ before the move; here
    those left in the run folder, where checkpoints/ held nothing to move), and back out of restored ones, so that
    each run's exports, metrics and evaluations stay its own (the trainer then drops only the records after the
    step it resumes from, MetricsLog.resume_from)."""
    if moved:
        # claim_dir names the folder <checkpoints>.<checkpoint fingerprint of the drafter moved aside>.
        carry_trained_outputs_into(run_dir, moved, moved.rsplit(".", 1)[1])
    bring_out_trained_outputs(run_dir, checkpoints)


def carry_trained_outputs_into(run_dir: str, folder: str, drafter: str) -> None:
    """The run folder's training outputs and the evaluations of `drafter` (a checkpoint fingerprint) moved into
    `folder` (under a free name where it holds one of the same name)."""
    for name in [*TRAINED_OUTPUTS, *eval_folders(run_dir, drafter)]:
        current = os.path.join(run_dir, name)
        if os.path.exists(current):
            os.replace(current, _unused_path(os.path.join(folder, name)))


def bring_out_trained_outputs(run_dir: str, checkpoints: str) -> None:
    """The outputs and evaluations inside `checkpoints` (restored with it, or put there before a move a kill
    interrupted) moved back to the run folder, each where the run folder has none of its name: they are the
    drafter's whose checkpoints those are."""
    for name in [*TRAINED_OUTPUTS, *eval_folders(checkpoints)]:
        inside, current = os.path.join(checkpoints, name), os.path.join(run_dir, name)
        if os.path.exists(inside) and not os.path.exists(current):
            os.replace(inside, current)


def eval_folders(folder: str, drafter: str | None = None) -> list[str]:
    """Names of the evaluation folders in `folder` besides `eval` (eval.out_dir=<run_dir>/eval_live, ...): those
    holding a summary.json. With `drafter` (a checkpoint fingerprint) only those of that drafter, and those whose done
    marker names none (an evaluation stopped halfway, or older than the record), which evaluated the drafter that
    was in the run folder then."""
    names = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        path = os.path.join(folder, name)
        # A hidden name is an evaluation killed before its swap (dflash/stages/evaluation.py), not one to move.
        if name in TRAINED_OUTPUTS or name.startswith(".") or not os.path.isfile(os.path.join(path, "summary.json")):
            continue
        marker = read_json_or_none(os.path.join(path, "done.json"))
        measured = marker.get("checkpoint") if isinstance(marker, dict) else None
        if drafter is None or measured in (None, drafter):
            names.append(name)
    return names


def _unused_path(path: str) -> str:
    """`path`, or `path.1`, `path.2`, ... : the first that does not exist."""
    candidate, k = path, 0
    while os.path.exists(candidate):
        k += 1
        candidate = f"{path}.{k}"
    return candidate

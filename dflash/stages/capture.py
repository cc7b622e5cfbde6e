"""The capture stage: the frozen target's hidden states at the drafter's taps, in `features/`.

Offline, a sharded feature store captured by every rank (each its share of the shards). Online and colocated, the
features are made while training; this stage only writes what the train stage needs. In every mode it also writes
the held-out samples' features, the target's frozen embedding and lm_head, and the target's shape (target.json),
which the later stages read instead of loading the target again.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from dflash.config import fingerprints
from dflash.run_files import claim_dir, clear_done, read_json_or_none, stage_done, write_json
from dflash.stages.closing import readable_bytes
from dflash.stages.context import RunContext
from dflash.stages.data import DataStage
from dflash.models.targets.mask_token import mask_token_name
from dflash.stages.shapes import drafter_config, mask_token_for, target_shape
from dflash.stages.stage import Stage

logger = logging.getLogger(__name__)


class CaptureStage(Stage):
    name = "capture"
    made = "captured"

    def __init__(self, run: RunContext, data: DataStage) -> None:
        self.context, self.data = run, data
        self.input_stage = data
        self.out = run.dirs["features"]

    @property
    def every_rank(self) -> bool:
        """Offline capture is split over every rank; the other modes only prepare files, on rank 0."""
        return self.context.settings.capture.mode == "offline" and self.context.world_size > 1

    @property
    def barrier_before(self) -> bool:
        """Offline capture on every rank starts after rank 0's data stage."""
        return self.every_rank

    def describe(self) -> str:
        s = self.context.settings
        taps = f"layers {s.drafter.target_layer_ids}" if s.drafter.target_layer_ids else \
            f"{s.drafter.num_taps} layers spread over its depth"
        where = {"offline": "into a feature store", "online": "streamed to the trainer while training",
                 "colocated": "made by each trainer rank while training"}[s.capture.mode]
        return f"the target's hidden states at {taps}, {where} ({s.capture.dtype})"

    def fingerprint(self) -> str:
        """The capture settings and what the data stage made (its stats.json), not only what it was asked."""
        stats = read_json_or_none(os.path.join(self.data.out, "stats.json")) or {}
        made = {k: stats.get(k) for k in ("fingerprint", "samples", "num_tokens")}
        return fingerprints.capture_fingerprint(self.context.settings, made)

    def prepare(self) -> None:
        """Before the done check: a finished offline store missing shards is not done (check_store), and features
        of other settings are moved aside (rank 0); every rank capturing offline waits for that."""
        run, out, key = self.context, self.out, self.fingerprint()
        mode = run.settings.capture.mode
        if run.rank == 0 and mode == "offline" and stage_done(out, key):
            self.check_store()
        if run.rank == 0 and not stage_done(out, key):
            # Features of other settings would be refused by the store: moved aside, not lost; those of these
            # settings come back from where an earlier change moved them.
            moved = claim_dir(out, key, stage="capture", contents="features")
            if moved:
                logger.info(f"[capture] features of other settings moved aside to {moved}")
        if mode == "offline":
            run.barrier()  # every rank captures offline (only rank 0 gets here otherwise): wait for the claim

    def kept(self) -> None:
        if self.context.rank == 0:
            self.ensure_sampled_heldout()

    def run(self) -> dict[str, Any] | None:
        """This rank's features; rank 0 also writes the held-out features, the frozen head and target.json."""
        from dflash.data.dataset import load_dataset_dir
        from dflash.extract.capture import check_disk
        from dflash.train.frozen_head import save_frozen_head

        run, out = self.context, self.out
        mode = run.settings.capture.mode
        shape = target_shape(run.target)
        dataset = load_dataset_dir(self.data.out)
        shape["mask_token_id"] = self.mask_token(dataset)
        shape["mask_token"] = mask_token_name(run.target.tokenizer, shape["mask_token_id"])
        config = drafter_config(run.settings, shape)  # checks taps, mask id and sizes before any work
        other_bytes = self.other_files_bytes(config.target_layer_ids) if run.rank == 0 else 0
        if mode in ("online", "colocated"):
            if run.rank == 0:
                check_disk(Path(out), None, other_bytes)
            summary = self.describe_streamed(mode, len(dataset), config.target_layer_ids)
        else:
            summary = self.capture_store(dataset, config.target_layer_ids, self.fingerprint(), other_bytes)
        if run.rank != 0:  # several ranks capture offline; the stage's other files are rank 0's
            run.release_target()  # frees this rank's device for training
            return None
        self.capture_heldout(config.target_layer_ids)
        head = os.path.join(out, "frozen_head.safetensors")
        save_frozen_head(run.target.embed_tokens().weight, run.target.lm_head_weight(), head,
                         run.target.logit_transform)
        logger.info(f"[capture] the target's embedding and lm_head, which the drafter shares frozen -> {head} "
                    f"({readable_bytes(os.path.getsize(head))})")
        write_json(os.path.join(out, "target.json"), shape)
        logger.info(f"[capture] {summary} -> {out}")
        if mode != "colocated":  # training reads features, not the target: its device memory goes to training
            run.release_target()  # (the eval stage loads it again when it runs)
        return {}

    def layer_ids(self, mode: str | None = None) -> list[int] | None:
        """The taps of the features in `out` as recorded there by capture `mode` (this command's by default: the
        store's manifest.json, online.json or colocated.json), or None when there is no such record."""
        mode = mode or self.context.settings.capture.mode
        record = read_json_or_none(os.path.join(self.out, "manifest.json" if mode == "offline" else f"{mode}.json"))
        taps = record.get("target_layer_ids") if isinstance(record, dict) else None
        return [int(i) for i in taps] if isinstance(taps, list) else None

    def mask_token(self, dataset, adapter=None) -> int:
        """The run's MASK token, checked against (or chosen clear of) the ids of the data and held-out sets; `adapter`:
        the target (or its vocabulary alone, load_target_vocabulary) to check it with, by default the run's target."""
        from dflash.data.dataset import load_heldout_dir
        from dflash.data.token_ids import token_ids_in

        used = token_ids_in(dataset) | token_ids_in(load_heldout_dir(self.data.out))
        token_id, line = mask_token_for(self.context.settings, adapter or self.context.target, used)
        if self.context.rank == 0:
            logger.info(f"[capture] {line}")
        return token_id

    def check_store(self) -> None:
        """A finished store whose listed shards are not all there (with capture.verify_existing: or not all intact)
        is not up to date: its done marker goes, and capture_dataset recaptures those shards (rank 0)."""
        from dflash.extract.capture import corrupt_shards, missing_shards
        from dflash.extract.store import read_manifest

        manifest = read_manifest(self.out)
        if manifest is None:
            return
        check = corrupt_shards if self.context.settings.capture.verify_existing else missing_shards
        bad = check(Path(self.out), manifest)
        if bad:
            named = ", ".join(f"{e['file']} (samples {e['first_sample']}..{e['first_sample'] + e['num_samples'] - 1})"
                              for e in bad[:5])
            logger.warning(f"[capture] {len(bad)} feature shard(s) missing or corrupt: {named}; recapturing them")
            clear_done(self.out)

    def describe_streamed(self, mode: str, num_samples: int, layer_ids: list[int]) -> str:
        """online.json / colocated.json: what the train stage's capture ranks and trainers need. The data they read
        is this run folder's data stage output, not a path recorded here: that would go stale when the folder moves
        (the readers ignore a "data" path in a record)."""
        c = self.context.settings.capture
        write_json(os.path.join(self.out, f"{mode}.json"), {
            "num_samples": num_samples, "target_layer_ids": layer_ids, "dtype": c.dtype,
            "batch_tokens": c.batch_tokens})
        return f"{num_samples} samples whose features are made during training ({mode} capture)"

    def other_files_bytes(self, layer_ids: list[int]) -> int:
        """Disk bytes of what rank 0 writes beside the features, counted before any work: the frozen head (embedding
        and lm_head, one of them when tied: ~5 GB for Qwen3.6-27B) and the held-out passes (each token's taps and
        final hidden state; those continued at train.best_by's temperature counted at their longest)."""
        from dflash.config.schema import best_by_temperature
        from dflash.data.dataset import load_heldout_dir
        from dflash.train.frozen_head import tied
        from dflash.train.heldout import prompt_length

        target = self.context.target
        embed, lm_head = target.embed_tokens().weight, target.lm_head_weight()
        head = embed.numel() * embed.element_size()
        if not tied(embed, lm_head):
            head += lm_head.numel() * lm_head.element_size()
        rows = load_heldout_dir(self.data.out)
        if rows is None:
            return head
        tokens = sum(len(ids) for ids in rows["input_ids"])
        if best_by_temperature(self.context.settings.train.best_by):
            tokens += sum(prompt_length(i, m) for i, m in zip(rows["id"], rows["loss_mask"])) + \
                len(rows) * self.sampled_heldout_budget()
        return head + tokens * (len(layer_ids) + 1) * target.hidden_size * embed.element_size()

    def capture_store(self, dataset, layer_ids: list[int], key: str, other_bytes: int) -> str:
        """This rank's shards of the offline feature store; `other_bytes`: what rank 0 writes beside them."""
        from dflash.extract.capture import capture_dataset
        from dflash.models.targets.compile_target import target_layers_compiled

        run, c = self.context, self.context.settings.capture
        with target_layers_compiled(run.target, c.compile):
            manifest = capture_dataset(run.target, dataset, self.out, layer_ids, batch_tokens=c.batch_tokens,
                                       shard_tokens=c.shard_tokens, dtype=c.dtype, check_every=c.check_every,
                                       verify_existing=c.verify_existing, fingerprint={"key": key},
                                       show_progress=run.show_progress, rank=run.rank, world_size=run.world_size,
                                       pack=c.pack, other_bytes=other_bytes)
        return f"{manifest['num_samples']} samples, {manifest['num_tokens']} tokens"

    def capture_heldout(self, layer_ids: list[int]) -> None:
        """The held-out samples' target features and greedy tokens, for the acceptance replay during training."""
        from dflash.data.dataset import load_heldout_dir
        from dflash.train.heldout import write_heldout_features

        path = os.path.join(self.out, "heldout.safetensors")
        rows = load_heldout_dir(self.data.out)
        if rows is None:
            if os.path.exists(path):
                os.remove(path)
            return
        info = write_heldout_features(self.context.target, rows, layer_ids, path,
                                      batch_size=self.context.settings.train.heldout_batch_size)
        logger.info(f"[capture] held-out: {info['samples']} samples, {info['tokens']} tokens -> {path}")
        self.capture_sampled_heldout(rows, layer_ids, path)

    def capture_sampled_heldout(self, rows, layer_ids: list[int], path: str) -> None:
        """train.best_by=tau_T<x>: the held-out prompts continued by the target sampled at x, beside `path`: the
        passes on which the held-out estimate at x is unbiased (write_sampled_heldout, docs/eval.md)."""
        from dflash.config.schema import best_by_temperature
        from dflash.train.heldout import sampled_path, write_sampled_heldout

        s = self.context.settings
        temperature = best_by_temperature(s.train.best_by)
        if not temperature:
            return
        target = sampled_path(path, temperature)
        info = write_sampled_heldout(self.context.target, rows, layer_ids, target, temperature=temperature,
                                     seed=s.data.seed, max_new_tokens=self.sampled_heldout_budget(),
                                     batch_size=s.train.heldout_batch_size)
        logger.info(f"[capture] held-out continued at T={temperature:g}: {info['samples']} samples, "
                    f"{info['tokens']} tokens -> {target}")

    def sampled_heldout_budget(self) -> int:
        s = self.context.settings
        return s.train.heldout_max_new_tokens or s.data.max_new_tokens

    def ensure_sampled_heldout(self) -> None:
        """An up-to-date capture whose held-out set lacks the passes train.best_by's temperature needs (best_by
        changed since it ran), or holds them continued with another budget than train.heldout_max_new_tokens'
        (recorded since), gets them anew; the target is loaded only then."""
        from dflash.config.schema import best_by_temperature
        from dflash.data.dataset import load_heldout_dir
        from dflash.train.heldout import HeldoutSet, sampled_budget, sampled_path

        temperature = best_by_temperature(self.context.settings.train.best_by)
        path = os.path.join(self.out, "heldout.safetensors")
        if not temperature or not os.path.exists(path):
            return
        sampled = sampled_path(path, temperature)
        if os.path.exists(sampled) and sampled_budget(sampled) in (None, self.sampled_heldout_budget()):
            return
        layer_ids = HeldoutSet(path, batch_size=self.context.settings.train.heldout_batch_size).layer_ids
        self.capture_sampled_heldout(load_heldout_dir(self.data.out), layer_ids, path)

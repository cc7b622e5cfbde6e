"""Settings that no longer exist, each with what replaces it, and overrides that change nothing. A command or a
`compose` that names one stops before any work with one line saying what to use instead (Hydra alone would only call
the key unknown, or accept the override and do nothing)."""

from __future__ import annotations

from dflash.config.errors import ConfigError
from dflash.config.unknown_keys import override_key

ONLINE_IS_RANKS = ("online capture's file spool was removed: capture=online is one torchrun job whose last "
                   "capture.ranks ranks capture and send the features to the other ranks, e.g. `torchrun "
                   "--nproc_per_node 2 -m dflash.train +experiment=tiny capture=online` (CPU) or `launch/one_node.sh "
                   "... capture=online 'capture.devices=[0,1]' 'train.devices=[2,3,4,5,6,7]'` (docs/capture.md, "
                   "\"Online capture\")")

# key -> what to do instead
REMOVED = {
    "capture.transport": "drop capture.transport (the job's ranks are the one transport)",
    "capture.spool_dir": "drop capture.spool_dir (no file lies between capture and training)",
    "capture.budget_bytes": "capture.in_flight bounds the micro-batches made ahead for each trainer rank",
    "capture.workers": "capture ranks on nodes of their own are the job's last ranks: launch/multi_node.sh "
                       "with capture.ranks=C (or capture.ranks_per_node=k on every node)",
    "capture.num_workers": "capture.ranks (or capture.ranks_per_node)",
    "capture.chunk_items": "drop capture.chunk_items",
    "capture.stale_after_s": "capture.timeout_s ends a job whose rank stops answering",
    "capture.max_restarts": "the launcher restarts the whole job: torchrun --max-restarts (MAX_RESTARTS for "
                            "launch/one_node.sh and launch/multi_node.sh)",
    "capture.threads": "OMP_NUM_THREADS, as for every rank",
}


# Overrides Hydra accepts and that change nothing (a dict override merges into the dict), with what does what they
# seem to ask. Written without spaces.
NO_OP = {
    "eval.prompt_sets={}": "a dict override adds to the prompt sets and never empties them: drop a set with "
                           "~eval.prompt_sets.NAME, add one with +eval.prompt_sets.NAME={source: ..., limit: ...}",
}


def refuse_removed_settings(overrides: list[str]) -> None:
    """ConfigError naming the first override of a removed setting, why it is gone and what replaces it, or of one
    that changes nothing (NO_OP) and what to write instead."""
    for override in overrides:
        key = override_key(override)
        if key in REMOVED:
            raise ConfigError(f"{key}: {ONLINE_IS_RANKS}; instead: {REMOVED[key]}")
        written = override.lstrip("+").replace(" ", "")
        if written in NO_OP:
            raise ConfigError(f"{written}: {NO_OP[written]}")

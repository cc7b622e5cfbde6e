"""An evaluation's summary files are written with the shared atomic writer (synced to disk), and its plot titles say
how the summary was measured."""

from __future__ import annotations

import os

from dflash.eval.evaluate import write_summary
from dflash.eval.metrics import StepTrace, acceptance_metrics
from dflash.eval.plots import per_position_title

def test_summary_files_are_synced_to_disk(tmp_path, monkeypatch):
    metrics = acceptance_metrics([StepTrace([2, 1], [1, 0], [1, 1])], 2)
    summary = {"schema_version": 2, "mode": "replay", "temperature": 0.0, "block_size": 2, "max_new_tokens": 4,
               "prompt_sets": {"a": metrics}, "overall": metrics}
    synced, fsync = [], os.fsync

    def record(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", record)
    write_summary(summary, str(tmp_path))
    names = {os.path.basename(path).split(".tmp")[0].lstrip(".") for path in synced}
    assert {"summary.json", "summary.csv"} <= names
    assert sorted(p for p in os.listdir(tmp_path) if not p.endswith(".png")) == ["summary.csv", "summary.json"]


def test_per_position_title_says_how_the_summary_was_measured():
    assert per_position_title({"mode": "replay", "temperature": 0.0, "block_size": 16}) == \
        "Acceptance per position, replay greedy (block size 16)"
    title = per_position_title({"mode": "live", "temperature": 0.7, "block_size": 8})
    assert "live T=0.7, sampled drafts" in title and "reedy" not in title  # a summary from before the rule was kept
    # Greedy and sampled drafts at one temperature are told apart, and a draft temperature is named.
    assert "live T=1.0, greedy drafts (" in per_position_title({"mode": "live", "temperature": 1.0, "block_size": 8,
                                                                 "draft_sampling": "greedy"})
    assert "T=1.0, sampled drafts at 0.8 (" in per_position_title({"mode": "live", "temperature": 1.0, "block_size": 8,
                                                                    "draft_sampling": "sampled",
                                                                    "draft_temperature": 0.8})

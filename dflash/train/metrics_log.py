"""Training metrics to metrics.jsonl (always), TensorBoard and wandb (offline unless configured otherwise)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from typing import Any

from dflash.console import verbose
from dflash.run_files import atomic_write

logger = logging.getLogger(__name__)

# The wandb run a training in this run folder logs to (its id and mode), kept beside wandb's own run folders: wandb/
# travels with the drafter it logged when that drafter is moved aside.
WANDB_RUN_ID = os.path.join("wandb", "dflash-run.json")


def missing_logger_package(tensorboard: bool, wandb_mode: str) -> str | None:
    """The setting whose logger package is not installed, with what to do, in one line; None when both are there.
    Found before any stage runs: otherwise training would stop at its first line, after the data and capture."""
    if wandb_mode != "disabled" and importlib.util.find_spec("wandb") is None:
        return (f"logging.wandb.mode={wandb_mode} needs the wandb package, which is not installed: "
                "`pip install wandb`, or logging.wandb.mode=disabled")
    if tensorboard and importlib.util.find_spec("tensorboard") is None:
        return ("logging.tensorboard=true needs the tensorboard package, which is not installed: "
                "`pip install tensorboard`, or logging.tensorboard=false")
    return None


def missing_wandb_credentials(wandb_mode: str) -> str | None:
    """At logging.wandb.mode=online with no wandb API key configured here, the setting and what to do, in one line
    (None otherwise): wandb.init would stop the training at its first line, after the data and capture, or wait
    there for a key typed at a prompt."""
    if wandb_mode != "online" or os.environ.get("WANDB_API_KEY") or _wandb_finds_credentials():
        return None
    return ("logging.wandb.mode=online: no wandb API key is configured here (set WANDB_API_KEY, or run `wandb "
            "login`); logging.wandb.mode=offline (the default) keeps the run's logs for `wandb sync`")


def _wandb_base_url() -> str:
    """The wandb server runs log to: WANDB_BASE_URL, else the one `wandb login --host` recorded in wandb's settings
    file, else wandb's own."""
    import configparser

    if os.environ.get("WANDB_BASE_URL"):
        return os.environ["WANDB_BASE_URL"]
    folder = os.environ.get("WANDB_CONFIG_DIR") or os.path.join(os.path.expanduser("~"), ".config", "wandb")
    settings = configparser.ConfigParser()
    try:
        settings.read(os.path.join(folder, "settings"), encoding="utf-8")
    except configparser.Error:  # a settings file wandb would refuse too: its server is wandb's own
        return "https://api.wandb.ai"
    return settings.get("default", "base_url", fallback="https://api.wandb.ai")


def _wandb_finds_credentials() -> bool:
    """Whether wandb finds an API key for its server (_wandb_base_url) without prompting: in its environment
    variables, the .netrc file or its settings."""
    import netrc
    from urllib.parse import urlparse

    base = _wandb_base_url()
    try:
        from wandb.sdk.lib.wbauth import authenticate_session

        return authenticate_session(host=base, source="dflash", prompt=False, update_session=False) is not None
    except Exception:  # a wandb release without this lookup: the .netrc entry that `wandb login` writes
        try:
            return netrc.netrc(os.environ.get("NETRC")).authenticators(urlparse(base).hostname or "") is not None
        except (OSError, netrc.NetrcParseError):
            return False


class MetricsLog:
    """Writes on rank 0 only; every other rank gets a log that accepts and drops records.

    wandb's run opens when training (re)starts at a known step (`resume_from`, or the first record): a training
    resumed online continues its run, rewound to the step it resumes from (wandb's `resume_from`) or, where wandb
    does not offer that, continued where it stopped, so that a preempted training is one run on wandb's site. wandb
    cannot resume an offline run (it ignores `resume` offline), so each start of an offline training is a run of
    its own, which the closing block names.
    """

    def __init__(self, run_dir: str, *, enabled: bool, tensorboard: bool, wandb_mode: str, wandb_project: str,
                 config: dict[str, Any]) -> None:
        self.enabled = enabled
        self._tensorboard = None
        self._wandb = None
        self._file = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._tensorboard_dir = os.path.join(run_dir, "tensorboard") if tensorboard else None
        self._wandb_start = None if wandb_mode == "disabled" else \
            dict(project=wandb_project, dir=run_dir, mode=wandb_mode, config=config)
        self._file = open(self.path, "a", encoding="utf-8")

    def resume_from(self, step: int) -> None:
        """Training (re)starts after `step` (0: from scratch): drop the records of later steps, which a killed run
        logged after its last checkpoint or an earlier run in this folder left, so that no step is logged twice or
        by two runs. TensorBoard hides its later events the same way (purge_step), and wandb rewinds an online run
        to `step`."""
        if not self.enabled:
            return
        self._file.close()
        with open(self.path, encoding="utf-8") as f:
            kept = [line for line in f if _record_step(line) <= step]
        atomic_write(self.path, "".join(kept))
        self._file = open(self.path, "a", encoding="utf-8")
        self._open_tensorboard(purge_step=step + 1)
        self._open_wandb(step)

    def _open_wandb(self, step: int) -> None:
        if self._wandb_start is None or self._wandb is not None:
            return
        import wandb

        start = self._wandb_start
        id_file = os.path.join(start["dir"], WANDB_RUN_ID)
        # Silent: no banner, no end-of-run sparklines and summary on the console (DFLASH_VERBOSE=1 shows them);
        # its log is run_dir/wandb/*/logs/debug.log, every figure is in metrics.jsonl.
        common = dict(start, reinit="finish_previous", settings=wandb.Settings(silent=not verbose()))
        earlier = read_run_id(id_file)
        if start["mode"] == "online" and earlier is not None and earlier["mode"] == "online":
            # Rewound to `step` (a preview wandb enables per account), else continued where it stopped (wandb then
            # drops the records of steps it has, those a killed run logged after its checkpoint), else a new run.
            for how in ({"resume_from": f"{earlier['id']}?_step={step}"}, {"id": earlier["id"], "resume": "allow"}):
                try:
                    self._wandb = wandb.init(**how, **common)
                    return
                except Exception as error:  # wandb's site may not offer the way, or not know the run
                    failed = error
            logger.warning(f"[train] wandb could not continue run {earlier['id']} at step {step:,} ({failed}); "
                           f"this start logs to a new run")
        self._wandb = wandb.init(**common)
        os.makedirs(os.path.dirname(id_file), exist_ok=True)
        # An online run's page (wandb warns on the console when an offline run's is asked for).
        url = self._wandb.url if start["mode"] == "online" else None
        atomic_write(id_file, json.dumps({"id": self._wandb.id, "mode": start["mode"], "url": url}) + "\n")

    def sync(self) -> None:
        """metrics.jsonl's records made durable (fsync): a checkpoint saved after them survives a power loss, and a
        training resumed from it logs only the steps after it."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def _open_tensorboard(self, purge_step: int | None = None) -> None:
        if self._tensorboard_dir is not None and self._tensorboard is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(self._tensorboard_dir, purge_step=purge_step)

    def log(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        self._open_wandb(0)  # a log whose training never said where it starts starts a new run
        self._file.write(json.dumps({"step": step, **values}) + "\n")
        self._file.flush()
        self._open_tensorboard()
        if self._tensorboard is not None:
            for key, value in values.items():
                self._tensorboard.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_run_id(path: str) -> dict | None:
    """The wandb run id file's {"id", "mode", "url"}; None where there is none or it cannot be read (a new run then)."""
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    ok = isinstance(record, dict) and isinstance(record.get("id"), str) and record.get("mode") in ("online", "offline")
    return record if ok else None


def _record_step(line: str) -> float:
    """The step of a metrics.jsonl line; infinity for a blank or torn line (a run killed mid-write), so it is
    dropped."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")


def read_records(path: str) -> list[dict]:
    """The whole records of a metrics.jsonl, by step (a resumed run appends: of a step logged twice, its last
    record); torn lines (a run killed mid-write) and records without a step count are skipped; [] without a file."""
    if not os.path.isfile(path):
        return []
    by_step: dict[int, dict] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                by_step[record["step"]] = record
    return [by_step[step] for step in sorted(by_step)]


# The ending line averages the records of the run's last ENDING_SHARE of steps, and at least ENDING_RECORDS of them
# where the last quarter of the steps holds that many: one step's figures are one micro-batch's, and an epoch's last
# can be a handful of samples (the CPU demo's last step read accuracy 0).
ENDING_SHARE, ENDING_RECORDS, ENDING_REACH = 0.05, 10, 0.25


def closing_records(run_dir: str) -> list[dict]:
    """The records the ending line averages (read_records of `run_dir`/metrics.jsonl): those of the last
    ENDING_SHARE of the steps, or the last ENDING_RECORDS within the last ENDING_REACH of them if that is more."""
    records = read_records(os.path.join(run_dir, "metrics.jsonl"))
    if not records:
        return []
    last = records[-1]["step"]

    def within(share: float) -> list[dict]:
        return [r for r in records if r["step"] >= last * (1 - share)]

    return max(within(ENDING_SHARE), within(ENDING_REACH)[-ENDING_RECORDS:], key=len)


def ending_line(records: list[dict]) -> str:
    """What training came to: its last step, and the mean loss, accuracy of the block's first position and the
    acceptance length those accuracies estimate over `records` (closing_records), with the held-out replay's tau
    where the last step measured it."""
    last = records[-1]
    parts = []
    for key, what, form in (("loss", "loss", ".3f"), ("acc_pos1", "first-position accuracy", ".3f"),
                            ("accept_len_est", "estimated tau", ".2f")):
        values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
        if values:
            parts.append(f"{what} {sum(values) / len(values):{form}}")
    first = records[0]["step"]
    steps = f"step {first:,}" if first == last["step"] else \
        f"the last {len(records)} logged steps ({first:,}-{last['step']:,}), on average"
    line = f"[train] done: {last['step']:,} steps"
    if parts:
        line += f"; over {steps}: " + ", ".join(parts) + " (of the training batches)"
    if isinstance(last.get("heldout/tau"), (int, float)):
        line += f"; held-out tau {last['heldout/tau']:.2f}"
    return line + "; the eval stage measures tau on the prompt sets"

"""The training command a run folder records, which `python -m dflash.eval` takes its settings from.

A run folder holds one drafter, and its fingerprints tie it to the data, capture and train settings it was
trained with (dflash/stages/guard.py): an evaluation given other ones would be refused. So the train stage records
the overrides of the command that trained (`checkpoints/settings.json`, "command"; Hydra's record, less `stages`
and `overwrite`), and an evaluation command that finds the run folder adopts them, its own overrides taking
precedence key by key: `python -m dflash.eval name=smollm2` measures what `python -m dflash.train
+experiment=smollm2 train.seed=1` trained, with the evaluation settings of that command unless it gives its own.
The folder itself (`name`, `run_dir`) is always the evaluation command's.
"""

from __future__ import annotations

import json
import os
import re
import sys

from dflash.config.hydra_flags import before_flags, full_flag, split_arguments
from dflash.config.unknown_keys import override_key
from dflash.run_files import SETTINGS_KEY

# Where the command is recorded, relative to the run folder.
RECORD = os.path.join("checkpoints", SETTINGS_KEY)
# Keys a recorded command never gives another one: the folder is found by the evaluation's own, a drafter must never
# be moved aside by an evaluation, and Hydra's own settings are each command's.
NOT_ADOPTED = ("name", "run_dir", "stages", "overwrite", "hydra")
# What the run folder follows from: a sweep over one of these is of several folders.
FOLDER_KEYS = ("name", "run_dir", "experiment")
# Hydra's flags under which a command adopts nothing: those that show no config, and those that compose another
# config than the evaluation's (whose run folder the recorded command would not be found by).
NOT_ADOPTING_FLAGS = ("-h", "--help", "--hydra-help", "--version", "-sc", "--shell-completion", "-cp", "--config-path",
                      "-cn", "--config-name", "-cd", "--config-dir", "--experimental-rerun")


def training_overrides(overrides: list[str] | None) -> list[str] | None:
    """What a run folder records of a training command's overrides (`overrides`, Hydra's record; None outside a
    Hydra command, which records nothing)."""
    if overrides is None:
        return None
    return [o for o in overrides if override_key(o) not in ("stages", "overwrite")]


def recorded_command(run_dir: str) -> list[str] | None:
    """The overrides of the command that trained the drafter in `run_dir` last, or None where none is recorded (no
    training there, one outside a Hydra command, or one from before the record)."""
    try:
        with open(os.path.join(run_dir, RECORD), encoding="utf-8") as f:
            command = json.load(f).get("command")
    except (OSError, ValueError, AttributeError):
        return None
    return command if isinstance(command, list) and all(isinstance(o, str) for o in command) else None


def adopted(arguments: list[str], run_dir: str) -> list[str]:
    """The recorded training command's overrides that `arguments` (an evaluation's) does not set itself, in the
    recorded order; none where the run folder recorded no command. An argument sets a key, what lies under it (a
    group choice `target=hf`, its settings) and what holds it (`eval.prompt_sets.gsm8k.limit=1`, the set)."""
    recorded = recorded_command(run_dir) or []
    # An argument the recorded command holds as it is agrees with it: what the command set under it stands.
    given = [override_key(a) for a in arguments if not a.startswith("-") and a not in recorded]
    return [o for o in recorded if re.split(r"[./]", override_key(o), maxsplit=1)[0] not in NOT_ADOPTED
            and o not in arguments and not any(overlaps(override_key(o), key) for key in given)]


def overlaps(key: str, other: str) -> bool:
    """Whether two dotted keys are one, or one holds the other."""
    return key == other or key.startswith(other + ".") or other.startswith(key + ".")


def with_training_command(arguments: list[str], located: list[str]) -> list[str]:
    """An evaluation command's `arguments` after the overrides it adopts from the training command recorded in the
    run folder that `located` (its arguments as they will run, the GPU default included) composes to, saying so;
    `arguments` as they are where it adopts none, gives a flag of NOT_ADOPTING_FLAGS (help, another config) or does
    not compose (its error is the command line's checks' to give). With Hydra's other flags (`--cfg job`, `--info`,
    `-m` with a sweep of evaluation settings) the config is the one that runs: the adopted overrides come first, the
    flags last."""
    from dflash.config import compose

    overrides, flags = split_arguments(arguments)
    # A flag Hydra does not have (`--epochs 3`) is refused by the command line's checks: nothing is said before.
    if any(full_flag(a) in NOT_ADOPTING_FLAGS or (a.startswith("-") and full_flag(a) is None) for a in flags):
        return arguments
    # A sweep (`-m eval.temperature=0.0,1.0`) evaluates one drafter under several settings: the folder is found
    # without it, unless it sweeps the folder itself.
    located_overrides = split_arguments(located)[0]
    swept = [o for o in located_overrides if is_sweep(o)]
    if any(overlaps(override_key(o), key) for o in swept for key in FOLDER_KEYS):
        return arguments
    folder = working_folder(located_overrides)
    if folder is None:
        return arguments
    try:
        run_dir = os.path.join(folder, str(compose([o for o in located_overrides if o not in swept], "eval").run_dir))
    except Exception:  # noqa: BLE001 - any composition error is reported by the checks that follow
        return arguments
    taken = adopted(overrides, run_dir)
    if not taken:
        return arguments
    if os.environ.get("LOCAL_RANK", "0") == "0":
        # Beside a flag stdout is the config Hydra shows (`--cfg job > config.yaml`): the line goes to stderr.
        print(f"dflash: the drafter of {run_dir}, with its training command's overrides: {' '.join(taken)}",
              file=sys.stderr if flags else sys.stdout, flush=True)
    # The folder stays the one found, whatever name an adopted +experiment= gives.
    return [*taken, *before_flags(arguments, *pinned_folder(overrides, run_dir))]


def working_folder(overrides: list[str]) -> str | None:
    """The folder a command of `overrides` runs in, which a relative run_dir lies in: the folder it starts in, or
    with `hydra.job.chdir=true` the `hydra.run.dir` it names (absolute; dflash's own is `.`, the start folder); None
    where that folder is named after the time the command starts (`${now:...}`: it cannot be known before)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    given = {}
    for override in overrides:
        if override_key(override) in ("hydra.job.chdir", "hydra.run.dir"):
            try:
                given[override_key(override)] = OverridesParser.create().parse_overrides([override])[0].value()
            except HydraException:
                return os.getcwd()  # Hydra refuses the command itself
    if not said_true(given.get("hydra.job.chdir")):
        return os.getcwd()
    folder = str(given.get("hydra.run.dir", "."))  # conf/train.yaml's hydra.run.dir
    return None if "${" in folder else os.path.abspath(folder)


def said_true(value) -> bool:
    """Whether an override's value is one of the words OmegaConf reads as true (`true`, `yes`, `on`, `y`, `1`)."""
    return value is True or str(value).lower() in ("true", "yes", "on", "y", "1")


def is_sweep(override: str) -> bool:
    """Whether `override` sweeps its key over several values (`a=1,2`, `a=range(1,3)`: Hydra's -m jobs); False for
    one Hydra cannot parse (its error comes later)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        return OverridesParser.create().parse_overrides([override])[0].is_sweep_override()
    except HydraException:
        return False


def pinned_folder(arguments: list[str], run_dir: str) -> list[str]:
    """`run_dir=<run_dir>` as an override Hydra reads whole (quoted where the path needs it), where `arguments` do
    not name run_dir and the path can be written; else nothing."""
    if any(override_key(a) == "run_dir" for a in arguments):
        return []
    written = hydra_value(run_dir)
    return [f"run_dir={written}"] if written is not None else []


def hydra_value(text: str) -> str | None:
    """`text` as a value Hydra's override parser reads back as that string: as it is where it is plain ASCII that
    reads as a string, else quoted (`'a b'`, `'true'`, `'1e-3'`); None where it holds a quote or backslash that
    quoting would change."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if re.fullmatch(r"[A-Za-z0-9_./+@:-]+", text) and \
            OverridesParser.create().parse_overrides([f"key={text}"])[0].value() == text:
        return text
    return f"'{text}'" if "'" not in text and "\\" not in text else None

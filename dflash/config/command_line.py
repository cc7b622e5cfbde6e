"""The command line of `python -m dflash.train`, `dflash.extract` and `dflash.eval` before Hydra reads it.

Three rewrites, all visible: the `--local_rank=N` the deepspeed launcher appends (Hydra rejects it) moves into the
LOCAL_RANK environment variable; an evaluation command takes the overrides of the training command its run folder
recorded where it does not set them itself (training_command.py, said on stdout, or on stderr beside a flag such as
`--cfg job`); and a command that names no experiment, target or device on a machine with a GPU runs the GPU default
(`+experiment=smollm2_quick`, a real drafter in about 10 minutes) instead of the CPU demo, saying so on stderr.
Overrides added go before Hydra's flags (hydra_flags.py). All three commands rewrite alike, so
`python -m dflash.eval` finds the run that `python -m dflash.train` made on the same machine. A setting that was
removed (dflash/config/removed.py) stops the command here with what replaces it, and so does a command line Hydra
cannot compose (composition_errors.py), a sweep two of whose jobs would spoil each other's results, and Hydra's own
output folder (hydra.run.dir, which dflash leaves empty unless hydra.job.chdir=true runs in it), in one line. Once
Hydra runs the command, `hydra_overrides` reads back the overrides it was given.
"""

from __future__ import annotations

import os
import re
import sys

from dflash.config import CONFIG_DIR
from dflash.config.composition_errors import (refuse_flags_between_overrides, refuse_shared_sweep_folder,
                                               refuse_uncomposable)
from dflash.config.errors import ConfigError, as_typed
from dflash.config.hydra_flags import before_flags, full_flag, split_arguments
from dflash.config.removed import refuse_removed_settings
from dflash.config.training_command import hydra_value, said_true, with_training_command
from dflash.config.unknown_keys import override_key, refuse_unknown_override_keys

# The installed distribution whose version --version prints (pyproject.toml's name).
DISTRIBUTION = "dflash-trainer"

GPU_DEFAULT = "+experiment=smollm2_quick"
_adopted: list[str] = []  # command_arguments' adoption, for adopted_overrides
# What the training command says first on a machine without a GPU when nothing chooses what to run.
CPU_DEMO_LINE = ("dflash: no GPU: this is the CPU demo, a drafter for the real SmolLM2 target trained for a few "
                 "minutes (5 to 6 minutes on 2 idle cores; tau near 1.05 is what minutes of CPU training reach); on "
                 "a machine with a GPU the same command trains a real drafter in about 10 minutes")
# What it says first on such a machine when the command names a target and no experiment: the default sizes, which
# a larger target makes longer.
CPU_TARGET_LINE = ("dflash: no GPU: this trains a drafter for the target named on the CPU with the default sizes, "
                   "which take 5 to 6 minutes for the 135M SmolLM2 and longer for a larger target; "
                   "+experiment=tiny runs every stage on a few prompts, as a first check")
GPU_DEFAULT_LINE = (f"dflash: a GPU and no experiment named: running {GPU_DEFAULT} (a SmolLM2 drafter in about 10 "
                    f"minutes); CUDA_VISIBLE_DEVICES= python -m dflash.train runs the CPU demo")
# The experiments sized for a GPU (conf/experiment/; the others run on a CPU in minutes), and what one takes there.
GPU_EXPERIMENTS = {"smollm2": "about 23 minutes on one GPU", "smollm2_quick": "about 10 minutes on one GPU",
                   "qwen36": "a node of GPUs"}
# What the training command says first on a machine without a GPU when the command names one of them.
CPU_GPU_EXPERIMENT_LINE = ("dflash: no GPU: +experiment={name} is sized for a GPU ({takes}); on this CPU its data "
                           "stage alone takes hours. The CPU demo is python -m dflash.train with no experiment; "
                           "+experiment=tiny runs every stage in seconds")
# Set by command_arguments, said by the pipeline (default_run_line).
_default_run_line: str | None = None
# Keys whose presence means the user chose what to run: the GPU default would override their choice.
CHOOSING_KEYS = ("experiment", "target", "device")


def strip_local_rank(argv: list[str]) -> list[str]:
    """Remove the `--local_rank=N` / `--local_rank N` the deepspeed launcher adds (Hydra rejects it) into LOCAL_RANK.

    The launcher also exports LOCAL_RANK; an existing value wins, as torch.distributed reads the environment.
    """
    kept, index = [], 0
    while index < len(argv):
        arg = argv[index]
        if arg.startswith("--local_rank=") or arg.startswith("--local-rank="):
            value = arg.split("=", 1)[1]
        elif arg in ("--local_rank", "--local-rank") and index + 1 < len(argv):
            value = argv[index + 1]
            index += 1
        else:
            kept.append(arg)
            index += 1
            continue
        if not value.isdigit():
            raise ValueError(f"--local_rank must be a non-negative integer, got {value!r}")
        os.environ.setdefault("LOCAL_RANK", value)
        index += 1
    return kept


def _override_key(arg: str) -> str:
    """The config key an override sets: `+experiment=x` -> experiment, `~target` -> target, `a.b=1` -> a."""
    return override_key(arg).split(".", 1)[0]


def chooses(argv: list[str]) -> bool:
    """Whether an override of `argv` chooses an experiment, a target or a device."""
    return any(_override_key(arg) in CHOOSING_KEYS for arg in split_arguments(argv)[0])


def cpu_run_line(argv: list[str]) -> str | None:
    """What a training command on a machine without a GPU says first: that it is the CPU demo when `argv` chooses
    nothing, that an experiment it names is sized for a GPU (GPU_EXPERIMENTS), what its sizes take when it names a
    target and no experiment, else nothing."""
    overrides = split_arguments(argv)[0]
    keys = {override_key(arg) for arg in overrides}
    chosen = {key.split(".", 1)[0] for key in keys}
    if not chosen & set(CHOOSING_KEYS):
        return CPU_DEMO_LINE
    experiment = next((arg.partition("=")[2] for arg in reversed(overrides) if override_key(arg) == "experiment"), None)
    if experiment in GPU_EXPERIMENTS:
        return CPU_GPU_EXPERIMENT_LINE.format(name=experiment, takes=GPU_EXPERIMENTS[experiment])
    names_target = bool(keys & {"target", "target.path"})  # not a setting of the target, such as target.dtype
    return CPU_TARGET_LINE if names_target and "experiment" not in chosen else None


def with_gpu_default(argv: list[str], has_gpu: bool) -> list[str]:
    """`argv` plus the GPU default when the machine has a GPU and no override chooses an experiment, target or
    device; otherwise `argv` unchanged."""
    if not has_gpu or chooses(argv):
        return argv
    return before_flags(argv, GPU_DEFAULT)


def version_line() -> str:
    """`dflash <version> (Hydra <version>)`: what --version prints."""
    from importlib.metadata import PackageNotFoundError, version

    import hydra

    try:
        ours = version(DISTRIBUTION)
    except PackageNotFoundError:  # run from a checkout that was not installed
        ours = "(not installed)"
    return f"dflash {ours} (Hydra {hydra.__version__})"


def repeated_keys(argv: list[str]) -> list[str]:
    """`KEY is given N times (...); the last, ARG, is the one used` for each key that overrides of `argv` set more
    than once (Hydra takes the last without a word; a script that appends to a base command may mean it)."""
    given: dict[str, list[str]] = {}
    for arg in split_arguments(argv)[0]:
        if "=" in arg and not arg.startswith("~"):  # keyed as written: Hydra refuses `+k=1 k=2` itself
            given.setdefault(arg.split("=", 1)[0], []).append(arg)
    return [f"{key} is given {len(args)} times ({', '.join(args)}); the last, {args[-1]}, is the one used"
            for key, args in given.items() if len(args) > 1]


# The stages each command other than dflash.train runs, whatever `stages` says (dflash/pipeline.run_command).
COMMAND_STAGES = {"extract": "the data and capture stages", "eval": "the eval stage"}


def refuse_stages_setting(argv: list[str], config_name: str) -> None:
    """ConfigError where `stages=` is given to a command that runs stages of its own (it would be dropped)."""
    if config_name not in COMMAND_STAGES:
        return
    for arg in split_arguments(argv)[0]:
        if override_key(arg) == "stages" and "=" in arg:
            raise ConfigError(f"{arg}: python -m dflash.{config_name} runs {COMMAND_STAGES[config_name]} itself; "
                              f"python -m dflash.train {arg} runs the stages named")


def refuse_target_kind_setting(argv: list[str]) -> None:
    """ConfigError where `target.kind=` is given: the target group's option chooses a target with every key it
    needs, while the kind alone keeps the other keys of the group in use (the smollm2 group's mask token for a
    checkpoint of one's own)."""
    for arg in split_arguments(argv)[0]:
        if override_key(arg) == "target.kind" and "=" in arg:
            kind = arg.partition("=")[2]
            path = " target.path=<checkpoint folder or .gguf file>" if kind == "hf" else ""
            raise ConfigError(f"{arg}: a target is chosen by its group, target={kind}{path}: target.kind alone keeps "
                              f"the other keys of the target group in use (its mask token among them)")


# What each command writes where Hydra's run folder would be (hydra.run.dir): conf/*.yaml keep Hydra's folder the
# working one, where Hydra writes nothing.
COMMAND_FOLDERS = {"train": "run_dir (runs/${name})", "extract": "run_dir (runs/${name})",
                   "eval": "eval.out_dir (<run_dir>/eval)"}


def refuse_hydra_run_dir(argv: list[str], config_name: str) -> None:
    """ConfigError where `hydra.run.dir=` is given: Hydra would make that folder empty, and the run would go to
    run_dir all the same. With hydra.job.chdir=true it is the working folder the run goes into (runs/<name> in it),
    and is let through."""
    overrides = split_arguments(argv)[0]
    if any(override_key(arg) == "hydra.job.chdir" and said_true(arg.partition("=")[2])
           for arg in overrides):
        return
    for arg in overrides:
        if override_key(arg) == "hydra.run.dir" and "=" in arg:
            folder = arg.partition("=")[2]
            # The working folder or an interpolation (${run_dir}, ${hydra:...}) is no run folder to give instead.
            path = "${" not in folder and os.path.normpath(folder or ".") != "."
            key = "eval.out_dir" if config_name == "eval" else "run_dir"
            chdir = "" if config_name == "eval" else " (or name=NAME), or add hydra.job.chdir=true to run in it"
            raise ConfigError(f"{arg}: dflash writes to {COMMAND_FOLDERS[config_name]}, not to Hydra's run folder, "
                              f"which would stay empty; give {key}={folder if path else '<a folder>'} instead{chdir}")


def command_arguments(argv: list[str], config_name: str = "train") -> list[str]:
    """The Hydra arguments of one of the three commands (its config `config_name`): `argv` without the launcher's
    --local_rank, for an evaluation after the overrides it adopts (training_command.py), with the GPU default when
    it applies (default_run_line says so, or that this is the CPU demo). A removed setting, a key that names no
    setting, hydra.run.dir, Hydra's flags between overrides, a sweep two of whose jobs would spoil each other's
    results, a flag Hydra does not have or a command line Hydra cannot compose ends the command with one line (exit
    status 2; HYDRA_FULL_ERROR=1 leaves the last two to Hydra)."""
    kept = strip_local_rank(argv)
    if any(full_flag(arg) == "--version" for arg in kept):  # Hydra's own flag would print Hydra's version alone
        print(version_line())
        sys.exit(0)
    import torch  # here: --version answers without loading it

    global _adopted
    typed = kept
    if config_name == "eval":
        kept = with_training_command(kept, with_gpu_default(kept, torch.cuda.is_available()))
        _adopted = [a for a in kept if a not in typed]
    arguments = with_gpu_default(kept, torch.cuda.is_available())
    try:
        refuse_removed_settings(kept)
        refuse_unknown_override_keys(kept, CONFIG_DIR)
        refuse_stages_setting(kept, config_name)
        refuse_target_kind_setting(kept)
        refuse_hydra_run_dir(kept, config_name)
        refuse_flags_between_overrides(arguments, config_name, typed)
        refuse_shared_sweep_folder(arguments, config_name, typed)
        if os.environ.get("HYDRA_FULL_ERROR") != "1":
            refuse_uncomposable(arguments, config_name, typed)
    except ConfigError as error:
        print(f"dflash: error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    if os.environ.get("LOCAL_RANK", "0") == "0":
        for warning in repeated_keys(kept):
            print(f"dflash: warning: {warning}", file=sys.stderr, flush=True)
    global _default_run_line
    _default_run_line = None
    flags = any(arg.startswith("-") for arg in kept)  # Hydra's flags (--cfg, --info, -m): no pipeline runs
    if os.environ.get("LOCAL_RANK", "0") == "0" and "--help" not in kept:
        if arguments != kept and flags:  # what --cfg job prints is the GPU default's config: said now
            print(GPU_DEFAULT_LINE, file=sys.stderr)
        elif arguments != kept:
            _default_run_line = GPU_DEFAULT_LINE
        elif config_name == "train" and not torch.cuda.is_available() and not flags:
            _default_run_line = cpu_run_line(kept)
    return arguments


def adopted_overrides() -> list[str]:
    """The overrides this process's evaluation command took from the training command its run folder recorded
    (dflash/config/training_command.py): not typed, so no setting of theirs is warned about as typed."""
    return list(_adopted)


def default_run_line() -> str | None:
    """What this process's command_arguments chose when its command line chose nothing (the CPU demo or the GPU
    default), as one line for local rank 0 to say; None otherwise. It is said once the settings are checked
    (Pipeline.run), so that a bad setting's error comes alone."""
    return _default_run_line


def hydra_overrides(settings=None) -> list[str] | None:
    """The overrides of the Hydra command that is running, as Hydra recorded them (`train.lr=1e-3`,
    `+experiment=smollm2`), each holding an interpolation with the value it took in this job (job_value_override,
    from `settings` where given); None outside a Hydra command (a config composed by a test or a notebook)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return [job_value_override(o, settings) for o in HydraConfig.get().overrides.task]


def job_value_override(override: str, settings=None) -> str:
    """`override` with the value it took in this job where its value holds an interpolation: `name=w-${hydra:job.num}`
    of a -m sweep is `name=w-1` in its second job, `eval.out_dir=${run_dir}/e` the folder it named. A command
    suggested or recorded from a job names that job's own folders, and `${hydra:job.num}` does not resolve outside a
    sweep. The value is the setting's in `settings` (the job's, resolved once); without settings, or for a key that
    names no setting, Hydra's own interpolations resolved here; any other override as it was given."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    if "$" not in override:
        return override
    try:
        parsed = OverridesParser.create().parse_overrides([override])[0]
        value = parsed.value()
    except HydraException:
        return override
    if not isinstance(value, str) or "${" not in value:
        return override
    found, setting = setting_at(settings, parsed.key_or_group)
    if found:
        written = written_value(setting)
    elif re.search(r"\$\{\s*hydra:", value):
        try:
            written = hydra_value(str(OmegaConf.create({"value": value}).value))
        except Exception:  # noqa: BLE001 - a value that does not resolve here is Hydra's to report, as given
            return override
    else:
        return override
    return f"{parsed.get_key_element()}={written}" if written is not None else override


def setting_at(settings, key: str) -> tuple[bool, object]:
    """(True, the value of the dotted `key` in `settings`: dataclasses by attribute, mappings by entry), or (False,
    None) where `settings` is None or holds no such key."""
    if settings is None:
        return False, None
    value = settings
    for part in key.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif part in getattr(value, "__dataclass_fields__", {}):  # a field, not a method or property
            value = getattr(value, part)
        else:
            return False, None
    return True, value


def written_value(value) -> str | None:
    """`value` as an override writes it for Hydra to read back the same (hydra_value for a string); None where it
    cannot be written."""
    return hydra_value(value) if isinstance(value, str) else as_typed(value)


def working_folder_overrides() -> list[str]:
    """What places a command in this Hydra job's working folder, where `hydra.job.chdir=true` runs it there (its
    run_dir, relative, lies inside it): the two overrides that put the next command in the same folder, with the
    folder as this job resolved it (not `${now:...}` again, not a -m job's subfolder); none otherwise."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized() or not HydraConfig.get().job.chdir:
        return []
    runtime = HydraConfig.get().runtime
    if os.path.realpath(runtime.output_dir) == os.path.realpath(runtime.cwd):  # nothing moved
        return []
    folder = hydra_value(runtime.output_dir)
    return ["hydra.job.chdir=true", f"hydra.run.dir={folder}"] if folder is not None else []

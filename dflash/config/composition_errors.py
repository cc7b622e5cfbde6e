"""A command line Hydra cannot compose, refused in one line that names the override and what it takes.

Hydra's own errors for these take six to twelve lines (the config search path, the structured config's classes)
and often leave out the fix: `train.epochs=1.5`, `stages=train`, `eval.prompt_sets=nonsense`, `deepspeed=zero4`,
`train.lr 1e-3`, `--epochs 3`, `a=1 -m b=2` (argparse's usage block). The commands compose their config once before
Hydra does (`refuse_uncomposable`), so such a line comes before any work, as every other bad setting does. A sweep
(`-m train.lr=1e-3,2e-3`) whose jobs would share one run folder is refused too (`refuse_shared_sweep_folder`): its
second job would find the first's drafter and be refused after the first had trained; the line gives the command
with a folder per job (`'name=lr${train.lr}'`).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import shlex
import typing
from typing import Any

from dflash.config.errors import ConfigError
from dflash.config.hydra_flags import HYDRA_FLAGS, MODE_FLAGS, full_flag, split_arguments
from dflash.config.schema import STAGES, RunSettings, field_default
from dflash.config import unknown_keys
from dflash.config.training_command import is_sweep
from dflash.config.unknown_keys import (ALIASES, BOOL_WORDS, ENTRY_SETTINGS, lookup_setting, other_mode_problem,
                                        override_key, settings_fields)

TYPE_WORDS = {int: "an int", float: "a number", bool: BOOL_WORDS, str: "a string"}


def setting_keys(cls: Any = RunSettings, prefix: str = "") -> list[str]:
    """Every dotted key of a setting that holds a value (not a group of settings)."""
    keys = []
    for name, hint in settings_fields(cls).items():
        if dataclasses.is_dataclass(hint):
            keys += setting_keys(hint, f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


def group_options(group: str) -> list[str]:
    """unknown_keys.group_options of this project's conf/."""
    from dflash.config import CONFIG_DIR

    return unknown_keys.group_options(group, CONFIG_DIR)


def refuse_unknown_flags(argv: list[str]) -> None:
    """ConfigError for an argument that starts with '-' and is no Hydra flag, with the override it may have meant
    (`--epochs 3` -> train.epochs=3), for a shortened Hydra flag that also begins a setting's name (`--exp=tiny`
    is --experimental-rerun to Hydra, but meant +experiment=tiny), and for two of Hydra's MODE_FLAGS at once."""
    modes: dict[str, str] = {}  # full mode flag -> the argument that gave it (a mode given twice is one mode)
    for index, arg in enumerate(argv):
        flag = arg.split("=", 1)[0]
        for full, short in MODE_FLAGS.items():
            if flag == short or (len(flag) > 2 and full.startswith(flag)):
                modes.setdefault(full, arg)
        if len(modes) > 1:
            raise ConfigError(f"{' and '.join(modes.values())}: Hydra takes one of {', '.join(MODE_FLAGS)} at a time")
        if not arg.startswith("-") or flag in HYDRA_FLAGS:
            continue
        name, _, value = arg.lstrip("-").partition("=")
        if not value and index + 1 < len(argv) and not argv[index + 1].startswith("-") and "=" not in argv[index + 1]:
            value = argv[index + 1]
        name = name.replace("-", "_")
        # argparse, which reads Hydra's flags, takes a long flag's unambiguous prefix too (--multi for --multirun).
        expanded = full_flag(arg)  # not a flag in full here: the one it begins, if only one
        if expanded is not None:
            begun = [key for key in [*setting_keys(), "experiment"] if key.rsplit(".", 1)[-1].startswith(name)]
            if begun:
                meant = _override(begun[0], value) if len(begun) == 1 else ""
                raise ConfigError(f"{arg}: Hydra takes this for its flag {expanded}; write its flags in full, "
                                  f"and settings as key=value{meant}")
            continue
        aliased, note = ALIASES.get(name.lower(), ((), ""))
        keys = list(aliased) or [key for key in setting_keys() if key == name or key.endswith("." + name)]
        keys = keys or difflib.get_close_matches(name, setting_keys(), n=1)
        meant = _override(keys[0], "" if note else value) if keys else ""  # a value counted otherwise is not ours
        raise ConfigError(f"{arg}: no such option; settings are given as key=value{meant}; --help lists the groups, "
                          f"docs/config.md every key")


def _override(key: str, value: str) -> str:
    """' (did you mean KEY=VALUE?)', with the + that choosing an experiment takes."""
    return f" (did you mean {'+' if key == 'experiment' else ''}{key}={value or '...'}?)"


def composition_problem(error: Exception, argv: list[str], existing: dict[str, list[str]] | None = None,
                        command: str = "train", typed: list[str] | None = None) -> str:
    """One line for an error of Hydra's composition of `argv`: the override it concerns and what that takes.
    existing: the entries each free-form mapping holds (for a key below one that is not there); command and typed:
    the command (`train`, `extract`, `eval`) and its arguments as typed, for the sweep a comma asks for."""
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException

    text = str(error)
    if isinstance(error, MissingConfigException):
        found = re.search(r"Could not find '([^'/]+)/([^']+)'", text)
        options = re.findall(r"^\t(\S+)$", text.split("Config search path:")[0], flags=re.MULTILINE)
        if found:
            group, option = found.groups()
            return f"{group}={option}: no such option; {group} takes {', '.join(options) or 'none here'}"
    if isinstance(error, ValueError) and text.startswith("Config group override must be a string"):
        # A number given for a group (`train=5`): Hydra names neither the override nor the group's options.
        for arg in argv:
            group, option = override_key(arg), arg.partition("=")[2]
            options = group_options(group) if "." not in group else []
            if options and option not in options:
                return f"{group}={option}: no such option; {group} takes {', '.join(options)}"
    if isinstance(error, OverrideParseException):
        tilde = next((arg for arg in argv if arg.partition("=")[2].startswith("~")), None)
        if "LexerNoViableAltException" in text and tilde is not None:
            key, _, value = tilde.partition("=")
            return (f"{tilde}: a value starting with ~ is read as Hydra's deletion mark (the shell left it "
                    f"unexpanded); quote it: {key}='{value}', or write the path in full")
        found = re.search(r"Error parsing override '([^']+)'", text)
        if found:
            arg = found.group(1)
            after = argv[argv.index(arg) + 1] if arg in argv and argv.index(arg) + 1 < len(argv) else None
            meant = f" (did you mean {arg}={after}?)" if after is not None and "=" not in after else ""
            return f"{arg}: an override is key=value{meant}"
    if isinstance(error, ConfigCompositionException):
        found = re.search(r"Ambiguous value for argument '([^']+)'", text)
        if found:
            key, _, value = found.group(1).partition("=")
            group = key.lstrip("+")
            typed = argv if typed is None else typed
            sweep = sweep_command(typed, command)
            apart = {"name": ", each in a run folder of its own", "run_dir": ", each in a run folder of its own",
                     "eval.out_dir": ", each with an evaluation folder of its own"}.get(
                per_job_folder(split_arguments(typed)[0], command)[1], "")
            if group_options(group):  # a config group: one option, or one job per option
                return f"{found.group(1)}: {group} takes one option; a comma sweeps, one job per option{apart}: {sweep}"
            return (f"{found.group(1)}: a comma sweeps, one job per value{apart}: {sweep}; a list is {key}=[{value}], "
                    f"a string with a comma is quoted: {key}='\"{value}\"'")
        found = re.search(r"Could not override '([^']+)'\. No match in the defaults list", text)
        if found:
            given = next((arg for arg in argv if override_key(arg) == found.group(1)), found.group(1))
            return f"{given}: {found.group(1)} is not chosen by default, so it is added with a +: +{given.lstrip('~')}"
        found = re.search(r"Could not append to config\. An item is already at '([^']+)'", text)
        if found:
            given = next((arg for arg in argv if override_key(arg) == found.group(1)), found.group(1))
            return (f"{given}: {found.group(1)} is there already, so it is set without the +: "
                    f"{given.lstrip('+')}")
        found = re.search(r"Error merging override (\S+?)=(.*)$", text.splitlines()[0])
        if found:
            return _merge_problem(found.group(1).lstrip("+"), found.group(2), error.__cause__)
        found = re.search(r"Could not override '([^']+)'", text)
        if found:
            return other_mode_problem(found.group(1)) or \
                _missing_entry_problem(found.group(1), f"{text}\n{error.__cause__ or ''}", existing or {})
    return f"the command line cannot be composed: {_first_line(text)}"


# Examples of a list setting's value by the type of its items.
LIST_EXAMPLES = {int: ("ints", "1,5,9"), float: ("numbers", "0.9,0.95"), str: ("strings", "a,b")}


def _merge_problem(key: str, value: str, cause: BaseException | None) -> str:
    kind = lookup_setting(key)[0]
    origin = typing.get_origin(kind)
    if dataclasses.is_dataclass(kind):
        return f"{key}={value}: {key} is a group of settings, not one value: set them one by one ({key}.<key>=...)"
    if (kind is dict or origin is dict) and key in ENTRY_SETTINGS:
        return (f"{key}={value}: {key} is a mapping of entries: change one with {key}.<name>.<key>=..., drop one with "
                f"~{key}.<name>, add one with +{key}.<name>.<key>=...")
    if kind is dict or origin is dict:
        return (f"{key}={value}: {key} is a mapping: change a key of it with {key}.<key>=..., add one with "
                f"+{key}.<key>=..., drop one with ~{key}.<key>")
    if kind is list or origin is list:
        item = (typing.get_args(kind) or (None,))[0]
        words, example = LIST_EXAMPLES.get(item, ("", value.strip("[]")))
        default = _default_of(key)
        if isinstance(default, list) and default:  # the setting's own default is the best example
            example = ",".join(str(part) for part in default)
        given = [part.strip() for part in value.strip("[]").split(",")]
        if value.strip("[]") and all(_parses(part, item) for part in given):  # the items were right: the value
            example = ",".join(given)
        return f"{key}={value}: expected a list{' of ' + words if words else ''}, e.g. {key}=[{example}]"
    if kind in TYPE_WORDS:
        return f"{key}={value}: expected {TYPE_WORDS[kind]}"
    return f"{key}={value}: {_first_line(str(cause) if cause is not None else 'cannot be set')}"


def _default_of(key: str) -> Any:
    """The default of the setting at the dotted `key` (None where the key names no field of a group)."""
    parent, _, name = key.rpartition(".")
    group = lookup_setting(parent)[0] if parent else RunSettings
    if not dataclasses.is_dataclass(group):
        return None
    return next((field_default(f) for f in dataclasses.fields(group) if f.name == name), None)


def _parses(text: str, kind: Any) -> bool:
    """Whether `text` reads as one item of type `kind` of a list setting (a string: any word but null)."""
    try:
        if kind in (int, float):
            kind(text)
    except ValueError:
        return False
    return bool(text) and text.lower() not in ("null", "none")


def _missing_entry_problem(key: str, text: str, existing: dict[str, list[str]]) -> str:
    missing = re.search(r"Key '([^']+)' (?:is )?not in", text)
    parts = key.split(".")
    name = missing.group(1) if missing else parts[-1]
    if name not in parts:  # a mapping given whole to a mapping setting: its keys are merged one by one, and refused
        return (f"{key}: its keys are given one by one: +{key}.{name}=... (a mapping given whole is merged into "
                f"what {key} holds)")
    parent = ".".join(parts[:parts.index(name)]) if name in parts else ".".join(parts[:-1])
    has = existing.get(parent) or []
    near = difflib.get_close_matches(name, has, n=1)
    if near:
        return f"{key}: {parent} has no entry {name!r} (did you mean {parent}.{near[0]}?)"
    holds = f" (it holds {', '.join(has)})" if has else ""
    # A new prompt set needs its source too (dflash/config/schema.py prompt_set), else the next command is refused.
    first = f"+{parent}.{name}.source=<a source> " if parent == "eval.prompt_sets" else ""
    return f"{key}: {parent} has no entry {name!r}{holds}; a + adds one: {first}+{key}=..."


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), text)


def refuse_uncomposable(argv: list[str], config_name: str, typed: list[str] | None = None) -> None:
    """ConfigError in one line where Hydra cannot compose `argv` for the command whose config is `config_name`,
    or where an argument is a flag Hydra does not have. A command line with one of Hydra's own flags (--help,
    --cfg, ...) is left to Hydra. typed: the arguments as typed, without those the command adds (the GPU default,
    an evaluation's adopted overrides), for the sweep a comma asks for."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from dflash.config import compose

    refuse_unknown_flags(argv)
    # Hydra's flags, and a sweep asked for as hydra.mode=MULTIRUN (which composing a single config cannot take),
    # are Hydra's to handle.
    if any(arg.startswith("-") or override_key(arg) == "hydra.mode" for arg in argv):
        return
    try:
        compose(argv, config_name)
    except ConfigError:
        raise
    except (HydraException, OmegaConfBaseException, ValueError) as error:
        raise ConfigError(composition_problem(error, argv, _entries_beside(error, argv, config_name), config_name,
                                              typed)) from error
    except (AssertionError, AttributeError) as error:  # OmegaConf's update of or below a null mapping fails so
        problem = _below_null_problem(argv, config_name)
        if problem is None:
            raise
        raise ConfigError(problem) from error


def _below_null_problem(argv: list[str], config_name: str) -> str | None:
    """The line for the first override that sets a key below a value that is null in the config composed without
    it (`target.tiny.hidden_size=64` where the target is not a tiny one); None if no override does."""
    from omegaconf import OmegaConf

    from dflash.config import compose

    for arg in argv:
        key = override_key(arg)
        if arg.startswith("~") or "=" not in arg or "." not in key:
            continue
        try:
            cfg = compose([other for other in argv if other is not arg], config_name)
        except Exception:  # noqa: BLE001 - the others cannot be composed either: not this override's problem
            continue
        parts = key.split(".")
        for depth in range(1, len(parts) + 1):
            parent = ".".join(parts[:depth])
            if OmegaConf.select(cfg, parent, default="absent") is not None:
                continue
            if depth == len(parts):  # a mapping given to a null one
                return f"{arg}: {key} is null in this config and takes no mapping here{_why_unused(cfg, key)}"
            return (f"{arg}: {parent} is null in this config, so it has no key {'.'.join(parts[depth:])} to set"
                    f"{_why_unused(cfg, parent)}")
    return None


def _why_unused(cfg: Any, key: str) -> str:
    """'; <why the config does not use setting `key`>' by its schema's `unused` reason (target.tiny: only a tiny
    target reads it, and target=tiny is the config that gives it a value), else ''."""
    from omegaconf import OmegaConf

    parent, _, name = key.rpartition(".")
    try:
        run = OmegaConf.to_object(cfg)
        group = run
        for part in parent.split(".") if parent else []:
            group = getattr(group, part)
        spec = next(f for f in dataclasses.fields(group) if f.name == name)
        why = spec.metadata["unused"](group, run) if "unused" in spec.metadata else ""
    except Exception:  # noqa: BLE001 - only a hint: the line is made without it
        why = ""
    first = key.split(".")[0]
    # The null value of a group's setting is the value of the group's option chosen: another option may give one.
    options = [f"{first}={option}" for option in group_options(first) if option in key.split(".")[1:]]
    chosen = f"; {options[0]} chooses a config that gives it one" if options else ""
    return (f"; {why}" if why else "") + chosen


def _entries_beside(error: Exception, argv: list[str], config_name: str) -> dict[str, list[str]]:
    """For an override below a mapping's entry that is not there: {the mapping's key: the entries it holds}, read
    from the config composed without that override; else {}."""
    from omegaconf import DictConfig, OmegaConf

    from dflash.config import compose

    found = re.search(r"Could not override '([^']+)'", str(error))
    missing = re.search(r"Key '([^']+)' (?:is )?not in", str(error.__cause__ or ""))
    if not (found and missing):
        return {}
    parts = found.group(1).split(".")
    if missing.group(1) not in parts:
        return {}
    parent = ".".join(parts[:parts.index(missing.group(1))])
    rest = [arg for arg in argv if arg.split("=", 1)[0] != found.group(1)]
    try:
        node = OmegaConf.select(compose(rest, config_name), parent)
    except Exception:  # noqa: BLE001 - only a hint: the line is made without it
        return {}
    return {parent: list(node.keys())} if isinstance(node, DictConfig) else {}


def refuse_flags_between_overrides(argv: list[str], command: str, typed: list[str]) -> None:
    """ConfigError where Hydra's flags stand between the overrides of `argv` (`name=w -m train.lr=1e-3,2e-3`): its
    argument parser takes the overrides before the flags or after them all, and prints its usage block for the
    rest. The line gives `typed` (`argv` as typed) with the flags first, and for a sweep a folder per job. A flag
    Hydra does not have is refuse_unknown_flags' to name."""
    overrides = split_arguments(argv)[0]
    queue, at = list(overrides), []  # the overrides' places: split_arguments keeps the order of both parts
    for index, arg in enumerate(argv):
        if queue and arg == queue[0]:
            at.append(index)
            queue.pop(0)
    between = [arg for index, arg in enumerate(argv) if at and at[0] < index < at[-1] and index not in at]
    if not between or any(arg.startswith("-") and full_flag(arg) is None for arg in between):
        return
    multirun = _multirun(between)
    first = "-m goes" if multirun else "Hydra's flags go"
    apart = multirun and per_job_folder(split_arguments(typed)[0], command)[1] is not None
    folders = ", and each job needs a folder of its own" if apart else ""
    raise ConfigError(f"{' '.join(between)}: Hydra reads its flags before the overrides or after them all, not "
                      f"between them; {first} first{folders}: {sweep_command(typed, command, multirun=False)}")


def _multirun(flags: list[str]) -> bool:
    """Whether Hydra's `flags` ask for a sweep (-m, --multirun, --multi)."""
    return any(full_flag(flag) in ("-m", "--multirun") for flag in flags)


def sweep_command(arguments: list[str], command: str, multirun: bool = True) -> str:
    """`python -m dflash.<command>` with `arguments` as Hydra runs them: its flags first (-m added if `multirun`),
    and, where a sweep's jobs would share a folder, that folder's setting made one per job (per_job_folder)."""
    overrides, flags = split_arguments(arguments)
    sweeping = _multirun(flags)
    if multirun and not sweeping:
        flags, sweeping = ["-m", *flags], True
    if sweeping:
        overrides = per_job_folder(overrides, command)[0]
    return " ".join([f"python -m dflash.{command}", *(shlex.quote(arg) for arg in [*flags, *overrides])])


# The stages each command runs (dflash/pipeline.run_command). A sweep's second job that finds the first's results
# of a stage before eval in the run folder is refused (dflash/stages/guard.py); one that finds the first's evaluation
# replaces it, saying so.
COMMAND_RUNS = {"train": STAGES, "extract": ("data", "capture"), "eval": ("eval",)}
# Interpolations that differ in each job of a sweep, whatever it sweeps.
PER_JOB = ("${hydra:job.num}", "${hydra:job.id}", "${hydra:job.override_dirname}")


def per_job_folder(overrides: list[str], command: str) -> tuple[list[str], str | None, list[str]]:
    """(`overrides` with a folder for each job of their sweep, the setting of the folder the jobs would share, the
    sweeps that need one), where the jobs would write one folder: the run folder (`name=w-lr${train.lr}`) where a
    swept setting changes what a stage before eval makes, the evaluation's (`eval.out_dir=...`) where it changes the
    evaluation only; (`overrides`, None, []) where each job has its folder already or the sweep changes no output."""
    given = {override_key(arg): arg.partition("=")[2] for arg in overrides if "=" in arg}
    sweeps = [arg for arg in overrides if "=" in arg and override_key(arg).split(".")[0] != "hydra" and is_sweep(arg)]
    levels = {arg: _folder_level(override_key(arg), command) for arg in sweeps}
    needs = [arg for arg in sweeps if levels[arg] is not None]
    # The run folder is run_dir where one is given outright, else runs/${name}.
    run_key = "run_dir" if "run_dir" in given and "${name}" not in given["run_dir"] else "name"
    folder = run_key if "run" in levels.values() else "eval.out_dir"
    folders = [given.get(key, "") for key in (run_key, folder)]
    if not needs or any(is_sweep(arg) for arg in overrides if override_key(arg) in ("name", "run_dir", folder)):
        return overrides, None, []
    swept = [override_key(arg) for arg in needs]
    # Every experiment names its run (conf/experiment/*.yaml: name: tiny), where the command names none.
    named = {"experiment"} if run_key == "name" and "name" not in given else set()
    if all(key in named or any(_names(value, key) for value in folders) for key in swept) or \
            any(mark in value for mark in PER_JOB for value in folders):
        return overrides, None, []
    # Without a name of its own, a job's run is named after the experiment that names it otherwise (runs/tiny).
    experiment = given.get("experiment") if "experiment" not in swept else None
    base = given.get(folder) or {"name": experiment, "eval.out_dir": "${run_dir}/eval"}.get(folder)
    value = "-".join([base, *map(_label, swept)] if base else map(_label, swept))
    given_at = [index for index, arg in enumerate(overrides) if "=" in arg and override_key(arg) == folder]
    kept = [arg for index, arg in enumerate(overrides) if index not in given_at[1:]]  # the last is the one used
    if given_at:
        kept[given_at[0]] = f"{folder}={value}"
        return kept, folder, needs
    return [*kept, f"{folder}={value}"], folder, needs


def _folder_level(key: str, command: str) -> str | None:
    """'run' where jobs of `command` that differ in `key` need run folders of their own, 'eval' where they need
    evaluation folders of their own, None where they can share them."""
    affects = set(_affects(key)) & set(COMMAND_RUNS[command])
    if affects - {"eval"}:
        return "run"
    return "eval" if affects else None


def _affects(key: str) -> tuple[str, ...]:
    """The stages a change of `key` reruns: its field's, the nearest enclosing field's for a key inside a free-form
    one (target.tiny.hidden_size), every field's of a group chosen (capture=online), every stage for an experiment."""
    if key == "experiment":
        return STAGES
    parts = key.split(".")
    while parts:
        parent, name = ".".join(parts[:-1]), parts[-1]
        group = lookup_setting(parent)[0] if parent else RunSettings
        if dataclasses.is_dataclass(group):
            for klass in (group, *group.__subclasses__()):
                spec = next((f for f in dataclasses.fields(klass) if f.name == name), None)
                if spec is not None and dataclasses.is_dataclass(settings_fields(klass)[name]):  # a group chosen
                    return tuple(stage for stage in STAGES if stage in _every_affect(settings_fields(klass)[name]))
                if spec is not None:
                    return tuple(spec.metadata.get("affects", ()))
        parts = parts[:-1]
    return ()


def _every_affect(group: type) -> set[str]:
    """The stages a change of any setting of `group` (its modes' included) reruns."""
    found: set[str] = set()
    for klass in (group, *group.__subclasses__()):
        kinds = settings_fields(klass)
        for spec in dataclasses.fields(klass):
            kind = kinds[spec.name]
            found |= _every_affect(kind) if dataclasses.is_dataclass(kind) else set(spec.metadata.get("affects", ()))
    return found


def _names(value: str, key: str) -> bool:
    """Whether a folder's `value` takes its name from setting or group `key` (`${train.lr}`, `${capture.mode}`,
    `${hydra:runtime.choices.capture}`)."""
    return any(mark in value for mark in (f"{{{key}}}", f"{{{key}.", f"choices.{key}}}"))


def _label(key: str) -> str:
    """What a job's folder name takes from the swept `key`: `lr${train.lr}`, or a group's choice."""
    if key == "experiment" or ("." not in key and group_options(key)):
        return f"${{hydra:runtime.choices.{key}}}"
    return f"{key.rsplit('.', 1)[-1]}${{{key}}}"


def refuse_shared_sweep_folder(typed: list[str], command: str) -> None:
    """ConfigError for a sweep (-m) whose jobs would write one run folder: the second would find the first's
    results, of other settings, and be refused once the first had run. The line gives the command with a run folder
    per job. An evaluation's jobs replace one another's folder, as a rerun does, and are left to run."""
    overrides, flags = split_arguments(typed)
    multirun = _multirun(flags) or any(override_key(arg) == "hydra.mode" and arg.partition("=")[2] == "MULTIRUN"
                                       for arg in overrides)
    if not multirun:
        return
    _, folder, needs = per_job_folder(overrides, command)
    if folder not in ("name", "run_dir"):
        return
    given = {override_key(arg): arg.partition("=")[2] for arg in overrides if "=" in arg}
    where = given["run_dir"] if folder == "run_dir" else f"runs/{given['name']}" if "name" in given else \
        "a run folder"
    raise ConfigError(f"{' '.join(needs)}: jobs of this sweep would share {where}, and the second would be refused "
                      f"for the first's results; give each job its own: {sweep_command(typed, command)}")

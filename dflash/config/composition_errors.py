"""A command line Hydra cannot compose, refused in one line that names the override and what it takes.

Hydra's own errors for these take six to twelve lines (the config search path, the structured config's classes)
and often leave out the fix: `train.epochs=1.5`, `stages=train`, `eval.prompt_sets=nonsense`, `deepspeed=zero4`,
`train.lr 1e-3`, `--epochs 3`, `a=1 -m b=2` (argparse's usage block). The commands compose their config once before
Hydra does (`refuse_uncomposable`), so such a line comes before any work, as every other bad setting does. A sweep
(`-m train.lr=1e-3,2e-3`) two of whose jobs would spoil each other's results is refused too
(`refuse_shared_sweep_folder`): Hydra's own sweeper expands it into its jobs, each composed as it would run, and two
that share a run folder where they make something of other settings, or an evaluation folder where they measure
different drafters, are named with the command that gives each job a folder of its own
(`'name=w-${hydra:job.num}'`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import itertools
import os
import re
import shlex
import typing
from typing import Any

from dflash.config import fingerprints
from dflash.config.errors import ConfigError
from dflash.config.hydra_flags import HYDRA_FLAGS, MODE_FLAGS, full_flag, split_arguments
from dflash.config.schema import RunSettings, field_default
from dflash.config import unknown_keys
from dflash.config.training_command import is_sweep
from dflash.run_files import shown
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


def list_setting(key: str) -> bool:
    """Whether the dotted `key` names a setting of the schema whose value is a list (stages, train.devices...)."""
    from dflash.config.schema import RunSettings

    owner: Any = RunSettings
    for part in key.split("."):
        hints = typing.get_type_hints(owner) if dataclasses.is_dataclass(owner) else {}
        if part not in hints:
            return False
        kind = hints[part]
        if typing.get_origin(kind) is typing.Union:  # Optional[...]: the type it holds when set
            held = [a for a in typing.get_args(kind) if a is not type(None)]
            kind = held[0] if len(held) == 1 else kind
        owner = kind
    return owner is list or typing.get_origin(owner) is list


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
        refused = next((arg for arg in argv if unparsable(arg)), "")
        problem = unquoted_value_problem(refused)
        if problem is not None:
            key, _, value = refused.partition("=")
            return f"{refused}: Hydra reads a value holding {problem} only when quoted: {key}='\"{value}\"'"
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
            fixed, given, _ = working_sweep(argv if typed is None else typed, command, argv)
            sweep = command_line(fixed, command)
            apart = {"name": ", each in a run folder of its own", "run_dir": ", each in a run folder of its own",
                     "eval.out_dir": ", each with an evaluation folder of its own"}.get(given[0], "") if given else ""
            if group_options(group):  # a config group: one option, or one job per option
                return f"{found.group(1)}: {group} takes one option; a comma sweeps, one job per option{apart}: {sweep}"
            if list_setting(group):  # a sweep would give it one item a job, a quoted string no list
                return f"{found.group(1)}: {key} is a list, written in brackets: {key}=[{value}]"
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


# What Hydra's grammar takes in a value left unquoted (besides letters and digits): a path, a number, an
# interpolation. A list or a mapping starts with [ or {, a quoted string with a quote.
UNQUOTED_VALUE = re.compile(r"[A-Za-z0-9_/\-+.:@*?$%~,= \\]*")


def unparsable(arg: str) -> bool:
    """Whether Hydra's parser refuses the override `arg` on its own (Hydra names the command line, not the override)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        OverridesParser.create().parse_overrides([arg])
    except Exception:  # noqa: BLE001 - any parse error is a refusal
        return True
    return False


def unquoted_value_problem(arg: str) -> str | None:
    """'non-ASCII letters' or 'the characters ( )' when `arg` (key=value), which Hydra cannot parse, has a plain value
    with characters Hydra's parser takes only inside quotes (`run_dir=/data/run(1)`, `name=ünï`); None otherwise,
    and for a value the suggested quotes would not hold (one with a quote of its own)."""
    key, equals, value = arg.partition("=")
    if not equals or arg.startswith("-") or not value or value[0] in "[{'\"" or UNQUOTED_VALUE.fullmatch(value) \
            or "'" in value or '"' in value:
        return None
    odd = sorted({c for c in value if not UNQUOTED_VALUE.fullmatch(c)})
    if all(not c.isascii() for c in odd):
        return "non-ASCII letters"
    return "the characters " + " ".join(c for c in odd if c.isascii())


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
    rest. The line gives `typed` (`argv` as typed) with the flags first, for a sweep as working_sweep gives it. A flag
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
    if _multirun(between):
        fixed, given, _ = working_sweep(typed, command, argv)
        first = "-m goes first" + (", and each job needs a folder of its own" if given else "")
    else:
        typed_overrides, flags = split_arguments(typed)
        fixed, first = [*flags, *typed_overrides], "Hydra's flags go first"
    raise ConfigError(f"{' '.join(between)}: Hydra reads its flags before the overrides or after them all, not "
                      f"between them; {first}: {command_line(fixed, command)}")


def _multirun(arguments: list[str]) -> bool:
    """Whether `arguments` ask Hydra for a sweep: -m (--multirun, --multi) or hydra.mode=MULTIRUN."""
    overrides, flags = split_arguments(arguments)
    return any(full_flag(flag) in ("-m", "--multirun") for flag in flags) or \
        any(override_key(arg) == "hydra.mode" and arg.partition("=")[2] == "MULTIRUN" for arg in overrides)


def command_line(arguments: list[str], command: str) -> str:
    """`python -m dflash.<command> <arguments>`, each quoted for the shell where it needs it."""
    return " ".join([f"python -m dflash.{command}", *(shlex.quote(arg) for arg in arguments)])


class Job(typing.NamedTuple):
    """One job of a sweep as it would run: its number (hydra.job.num), settings and folders (absolute)."""
    num: int
    settings: RunSettings
    run_dir: str
    eval_dir: str


def sweep_jobs(arguments: list[str], command: str, refused: list[tuple[int, ConfigError]] | None = None) -> list[Job]:
    """The jobs of `python -m dflash.<command> -m <arguments>` as Hydra makes them, without running them: its basic
    sweeper expands the sweep into each job's overrides and its launcher composes each job's config from them
    (hydra/_internal/core_plugins/). A job whose config does not compose or check is left out (its number and
    ConfigError appended to `refused`, when given, for a setting the schema refuses), and so is every job of a
    sweep Hydra cannot expand: the run reports them."""
    from hydra import initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from dflash.config import CONFIG_DIR

    jobs, before = [], HydraConfig.instance().cfg
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        hydra = GlobalHydra.instance().hydra
        try:
            master = hydra.compose_config(command, split_arguments(arguments)[0], run_mode=RunMode.MULTIRUN)
            HydraConfig.instance().set_config(master)
            str(master.hydra.sweep.dir)  # its time is resolved once, in the cache each job's config copies
            parser = OverridesParser.create(config_loader=hydra.config_loader)
            task = OmegaConf.to_container(master.hydra.overrides.task)  # as typed: `name=w-${hydra:job.num}`
            batch = BasicSweeper.split_arguments(parser.parse_overrides(task), None)[0]
            for num, overrides in enumerate(batch):
                try:
                    jobs.append(_job(hydra.config_loader.load_sweep_config(master, list(overrides)), num))
                except ConfigError as error:  # a setting the schema refuses: the caller may say so first
                    if refused is not None:
                        refused.append((num, error))
                except Exception:  # noqa: BLE001 - a job that does not compose is the run's to report
                    continue
        except Exception:  # noqa: BLE001 - a sweep Hydra cannot expand is Hydra's to report
            pass
        finally:
            HydraConfig.instance().cfg = before
    return jobs


def _job(cfg: Any, num: int) -> Job:
    """Job `num` of a sweep from its config `cfg` (Hydra's node included), resolved as Hydra's run_job resolves it
    (hydra/core/utils.py): with its number, its output folder (the working folder under hydra.job.chdir=true) and
    the environment it sets (hydra.job.env_set)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.utils import env_override
    from omegaconf import open_dict, read_write

    from dflash.config import settings_from

    with open_dict(cfg):
        cfg.hydra.job.id = cfg.hydra.job.num = num
    HydraConfig.instance().set_config(cfg)
    output = os.path.abspath(os.path.join(str(cfg.hydra.sweep.dir), str(cfg.hydra.sweep.subdir)))
    with read_write(cfg.hydra.runtime), open_dict(cfg.hydra.runtime):
        cfg.hydra.runtime.output_dir = output
    HydraConfig.instance().set_config(cfg)
    job, task = HydraConfig.get().job, cfg.copy()
    with read_write(task), open_dict(task):
        del task["hydra"]
    with env_override(job.env_set):
        settings = settings_from(task)
    run_dir = os.path.join(output if job.chdir else os.getcwd(), settings.run_dir)
    eval_dir = os.path.join(run_dir, settings.eval.out_dir or "eval")  # an absolute out_dir is itself
    return Job(num, settings, os.path.normpath(run_dir), os.path.normpath(eval_dir))


# The stages dflash.extract and dflash.eval run (dflash/pipeline.run_command); dflash.train runs its `stages`.
COMMAND_RUNS = {"extract": ("data", "capture"), "eval": ("eval",)}
# What a job makes before its evaluation, by the last stage it runs of these (train runs export too), and the
# fingerprint of that stage's settings, which holds its input stage's (dflash/config/fingerprints.py).
MADE = {"data": ("the data", fingerprints.data_fingerprint),
        "capture": ("the features", lambda settings: fingerprints.capture_fingerprint(settings, {})),
        "train": ("the drafter", fingerprints.settings_fingerprint),
        "export": ("the drafter", fingerprints.settings_fingerprint)}


def sweep_conflict(jobs: list[Job], command: str) -> tuple[str, str, Job] | None:
    """For the first two of a sweep's `jobs` that would spoil each other's results: (the folder setting to give each
    job, what the two would do, the first of them). Those that share a run folder where a stage before eval that
    they run makes something of other settings come first (the second job is refused for the first's drafter, or
    replaces its data or features), then those that share an evaluation folder measuring different drafters (of two
    run folders, or of other training settings). None where no two do: jobs that differ in eval settings alone
    replace one another's evaluation, saying so, as a rerun does."""
    def runs(job: Job) -> typing.Sequence[str]:
        return job.settings.stages if command == "train" else COMMAND_RUNS[command]

    @functools.cache
    def made(num: int, stage: str) -> str:
        return MADE[stage][1](settings[num])

    settings = {job.num: job.settings for job in jobs}
    pairs = list(itertools.combinations(jobs, 2))
    for a, b in pairs:
        before = [stage for stage in MADE if stage in {*runs(a), *runs(b)}]
        if a.run_dir == b.run_dir and before and made(a.num, before[-1]) != made(b.num, before[-1]):
            named = os.path.normpath(a.settings.run_dir) == os.path.normpath(f"runs/{a.settings.name}")
            return ("name" if named else "run_dir", f"jobs {a.num} and {b.num} of this sweep would make "
                    f"{MADE[before[-1]][0]} of other settings in one run folder, {shown(a.run_dir)}", a)
    for a, b in pairs:
        if "eval" in runs(a) and "eval" in runs(b) and a.eval_dir == b.eval_dir and (
                a.run_dir != b.run_dir or made(a.num, "train") != made(b.num, "train")):
            whose = "the drafters of two run folders" if a.run_dir != b.run_dir else "drafters of other settings"
            return ("eval.out_dir", f"jobs {a.num} and {b.num} of this sweep would evaluate {whose} into one "
                    f"evaluation folder, {shown(a.eval_dir)}", a)
    return None


def working_sweep(typed: list[str], command: str, ran: list[str] | None = None) -> tuple[list[str], list[str],
                                                                                        str | None]:
    """(`typed` as a sweep that runs: -m first and, where two of its jobs would spoil each other's results
    (sweep_conflict), each job's folder named after its number, `name=<name>-${hydra:job.num}`; the folder
    settings so given; what the first conflict was, None where there was none). ran: the arguments the command
    runs, `typed` with what it adds (an evaluation's adopted overrides, the GPU default); `typed` where None."""
    overrides, flags = split_arguments(typed)
    flags = flags if _multirun(typed) else ["-m", *flags]
    ran_overrides, given, first = split_arguments(typed if ran is None else ran)[0], [], None
    while True:
        conflict = sweep_conflict(sweep_jobs(ran_overrides, command), command)
        if conflict is None or conflict[0] in given:  # a folder per job given: what is left is the run's to report
            return [*flags, *overrides], given, first
        key, what, job = conflict
        first, per_job = first or what, f"{key}={_base(ran_overrides, key, job)}-${{hydra:job.num}}"
        given.append(key)
        overrides, ran_overrides = _replaced(overrides, key, per_job), _replaced(ran_overrides, key, per_job)


def _base(overrides: list[str], key: str, job: Job) -> str:
    """What each job's folder `key` is named after: the value `overrides` give it as typed, the experiment's name
    where they sweep experiments, else `job`'s (the first of a sweep of folders; an evaluation's: ${run_dir}/eval)."""
    given = [arg for arg in overrides if "=" in arg and override_key(arg) == key and not is_sweep(arg)]
    if given:
        return given[-1].partition("=")[2]
    if key == "name" and any(override_key(arg) == "experiment" and is_sweep(arg) for arg in overrides):
        return "${hydra:runtime.choices.experiment}"
    return {"name": job.settings.name, "run_dir": job.settings.run_dir,
            "eval.out_dir": job.settings.eval.out_dir or "${run_dir}/eval"}[key]


def _replaced(overrides: list[str], key: str, new: str) -> list[str]:
    """`overrides` with `new` in place of those of `key` (where the first was; else last)."""
    at = next((index for index, arg in enumerate(overrides) if "=" in arg and override_key(arg) == key),
              len(overrides))
    kept = [arg for arg in overrides if not ("=" in arg and override_key(arg) == key)]
    return [*kept[:at], new, *kept[at:]]


def refuse_shared_sweep_folder(arguments: list[str], command: str, typed: list[str]) -> None:
    """ConfigError before the first job of a sweep (-m) one of whose jobs has a setting the schema refuses (naming
    the job and the setting), or two of whose jobs would spoil each other's results (sweep_conflict), in one line
    naming the swept overrides and the folder, with the command that gives each job its own (working_sweep).
    `arguments`: the command line as the command runs it; `typed`: as typed."""
    flags = split_arguments(arguments)[1]
    if not _multirun(arguments) or any(full_flag(flag) not in ("-m", "--multirun") for flag in flags):
        return  # no sweep, or one that Hydra shows (--help, --cfg) rather than runs
    refused: list[tuple[int, ConfigError]] = []
    sweep_jobs(split_arguments(arguments)[0], command, refused)
    if refused:  # before the jobs ahead of it run for minutes or hours
        num, error = refused[0]
        raise ConfigError(f"job {num} of this sweep: {error}; no job was run")
    fixed, _, conflict = working_sweep(typed, command, arguments)
    if conflict is not None:
        swept = [arg for arg in split_arguments(typed)[0] if is_sweep(arg)]
        raise ConfigError(f"{' '.join(swept)}: {conflict}; give each job its own: {command_line(fixed, command)}")

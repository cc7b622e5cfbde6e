"""Keys that name no setting, refused in one line with the nearest setting's name: in a command's overrides (before
Hydra, whose own error for `train.lrr=0.1` takes eight lines) and in a composed config (Hydra adds `+train.lrr=0.1`
without a word, and the run would go on without the learning rate its user meant to set). The name another trainer
gives a setting (`learning_rate`) is answered with ours, and an override the shell split or that has spaces around
its `=` (`train.betas=[0.9, 0.95]` unquoted, `train.lr = 1e-3`) is named whole, where Hydra would name a piece."""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dflash.config.errors import ConfigError
from dflash.config.schema import PromptSetSettings, RunSettings

# First parts of override keys that are not settings: Hydra's own, and the experiment group an override selects.
NOT_SETTINGS = ("hydra", "experiment")
# Mappings of named entries whose values are settings of their own: an entry's keys are looked up in its dataclass
# (the schema types the mapping's values Any, for OmegaConf to take a whole entry given as a mapping).
ENTRY_SETTINGS = {"eval.prompt_sets": PromptSetSettings}
# What OmegaConf reads as a bool: YAML 1.1's words, which YAML users type, and any int (refused but 0 and 1).
BOOL_WORDS = "true or false (or yes/no, on/off, y/n, 1/0)"
# Names other trainers (Hugging Face's Trainer, Lightning, SpecForge) give our settings -> ours, and what differs
# where ours is counted otherwise. Only where ours is that concept: a key that names no setting is answered with these
# before the nearest spelling (train.learning_rate is nowhere near train.lr).
ALIASES: dict[str, tuple[tuple[str, ...], str]] = {
    "learning_rate": (("train.lr",), ""),
    "batch_size": (("train.micro_batch_size",), ""),
    "per_device_train_batch_size": (("train.micro_batch_size",), ""),
    "gradient_accumulation_steps": (("train.grad_accum",), ""),
    "accumulate_grad_batches": (("train.grad_accum",), ""),
    "num_epochs": (("train.epochs",), ""),
    "num_train_epochs": (("train.epochs",), ""),
    "max_epochs": (("train.epochs",), ""),
    "warmup_steps": (("train.warmup_ratio",), "a share of the steps, not a count"),
    "num_warmup_steps": (("train.warmup_ratio",), "a share of the steps, not a count"),
    "warmup": (("train.warmup_ratio",), "a share of the steps"),
    "wd": (("train.weight_decay",), ""),
    "max_grad_norm": (("train.grad_clip",), ""),
    "gradient_clip_val": (("train.grad_clip",), ""),
    "clip_grad_norm": (("train.grad_clip",), ""),
    "grad_norm_clip": (("train.grad_clip",), ""),
    "min_lr": (("train.min_lr_ratio",), "a share of train.lr"),
    "adam_beta1": (("train.betas",), "a list of both betas"),
    "adam_beta2": (("train.betas",), "a list of both betas"),
    "random_seed": (("data.seed", "train.seed", "eval.seed"), ""),
    "max_seq_length": (("data.max_length",), ""),
    "max_seq_len": (("data.max_length",), ""),
    "gradient_checkpointing": (("train.activation_checkpointing",), ""),
    "output_dir": (("run_dir",), ""),
    "logging_steps": (("train.log_every",), ""),
    "save_steps": (("train.save_every",), ""),
    "save_total_limit": (("train.keep_last",), ""),
    "target_model_path": (("target.path",), ""),
}


def settings_fields(cls: type) -> dict[str, Any]:
    """Field name -> type of a settings dataclass and of its subclasses (the capture modes add fields of their
    own), with Optional[...] unwrapped."""
    found: dict[str, Any] = {}
    for klass in (cls, *cls.__subclasses__()):
        for name, hint in typing.get_type_hints(klass).items():
            if name in {f.name for f in dataclasses.fields(klass)}:
                args = [a for a in typing.get_args(hint) if a is not type(None)]
                found[name] = args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint
    return found


def override_key(override: str) -> str:
    """The dotted key an override sets or deletes: `+train.lr=1e-3` -> train.lr, `~eval.prompt_sets.gsm8k` ->
    eval.prompt_sets.gsm8k, `++x=1` -> x."""
    return override.lstrip("+~").split("=", 1)[0]


def lookup_setting(key: str) -> tuple[Any, str | None]:
    """The schema's type of the dotted `key` (Optional unwrapped) and None; or (None, why `key` names no setting,
    with the nearest one); or (None, None) for a key inside a free-form field such as target.tiny, whose keys the
    schema checks itself. Below an entry of ENTRY_SETTINGS (eval.prompt_sets.gsm8k.limit), the entry's settings."""
    parts = key.split(".")
    cls: Any = RunSettings
    depth = 0
    while depth < len(parts):
        entries = ENTRY_SETTINGS.get(".".join(parts[:depth]))
        if entries is not None:  # parts[depth] names an entry, any name: its keys are the entry's settings
            cls, depth = entries, depth + 1
            continue
        if cls in (int, float, bool, str):
            one = ".".join(parts[:depth])
            return None, f"{key}: {one} is one value ({cls.__name__}), not a group of settings: {one}=..."
        if not dataclasses.is_dataclass(cls):
            return None, None
        fields = settings_fields(cls)
        if parts[depth] not in fields:
            return None, _no_such(".".join(parts[:depth + 1]), ".".join(parts[:depth]), fields)
        cls = fields[parts[depth]]
        depth += 1
    return cls, None


def unknown_key_problem(key: str) -> str | None:
    """Why the dotted `key` of an override names no setting (with the nearest one), or None when it names one (or
    lies below a free-form field, or is not a setting at all: Hydra's keys, a group's package)."""
    if key.split(".")[0] in NOT_SETTINGS or any(c in key for c in "@/"):
        return None
    return lookup_setting(key)[1]


def refuse_unknown_override_keys(overrides: list[str], config_dir: str) -> None:
    """ConfigError naming the first override whose key names no setting, that selects an experiment
    `config_dir`/experiment/ does not hold or a second one, that deletes a setting, that sets an entry of a mapping
    of ENTRY_SETTINGS to null, or that gives a bool setting an int other than 0 or 1; or an override the shell split
    or that has spaces around its `=` (split_override_problem). Hydra's flags and their values (`--cfg job`) are not
    overrides: an override sets (`key=value`) or deletes (`~key`)."""
    problem = split_override_problem(overrides) or _experiments_problem(overrides, config_dir)
    if problem is not None:
        raise ConfigError(problem)
    for override in overrides:
        if override.startswith("-") or ("=" not in override and not override.startswith("~")):
            continue
        key, value = override_key(override), override.partition("=")[2]
        problem = unknown_key_problem(key) if key != "experiment" else unknown_experiment_problem(value, config_dir)
        if problem is None and key.split(".")[0] not in NOT_SETTINGS:
            problem = (_deletion_problem(override, key) or _null_entry_problem(override, key, value)
                       or _loose_bool_problem(key, value))
        if problem is not None:
            raise ConfigError(problem)


def split_override_problem(arguments: list[str]) -> str | None:
    """Why arguments of a command line are one override the shell split at its spaces or that has spaces around its
    `=` (`'train.lr = 1e-3'`, `train.lr= 1e-3`, `train.betas=[0.9, 0.95]` unquoted), with the override to type; None
    if none is. Hydra reads each argument as an override: its errors name a key `train.lr ` or a parser's input."""
    for index, arg in enumerate(arguments):
        if arg.startswith("-"):
            continue
        key, equals, value = arg.partition("=")
        after = arguments[index + 1:]
        pieces = []
        if not equals and after[:1] == ["="] and after[1:2] and _bare(after[1]):  # train.lr = 1e-3
            pieces = [arg, *after[:2]]
        elif not equals and after and after[0].startswith("="):  # train.lr =1e-3
            pieces = [arg, after[0]]
        elif equals and not value and after and _bare(after[0]):  # train.lr= 1e-3
            pieces = [arg, after[0]]
        elif equals and (key != key.strip() or value != value.lstrip()):  # 'train.lr = 1e-3'
            pieces = [arg]
        if pieces:
            typed = " ".join(pieces)
            key, _, value = typed.partition("=")
            return f"{typed}: an override has no spaces around its =; write {key.strip()}={value.strip()}"
        if equals and value.lstrip()[:1] in ("[", "{") and _depth(value) > 0:
            end = index + 1
            while end < len(arguments) and _depth(" ".join(arguments[index:end])) > 0 and _bare(arguments[end]):
                end += 1
            typed = " ".join(arguments[index:end])
            if end > index + 1 and _depth(typed) == 0:
                kind = "list" if value.lstrip().startswith("[") else "mapping"
                compact = re.sub(r"\s*([,:\[\]{}])\s*", r"\1", typed)
                return (f"{typed}: the shell split this {kind} at its spaces; quote it: '{typed}', or drop the "
                        f"spaces: {compact}")
    return None


def _bare(arg: str) -> bool:
    """Whether `arg` is neither an override nor a flag: a piece of one the shell split off."""
    return "=" not in arg and not arg.startswith(("-", "~", "+"))


def _depth(text: str) -> int:
    """How many of the brackets `text` opens it leaves open."""
    return sum(text.count(c) for c in "[{") - sum(text.count(c) for c in "]}")


def _experiments_problem(overrides: list[str], config_dir: str) -> str | None:
    """Why `+experiment=a +experiment=b` cannot run (Hydra's own error advises a defaults-list line, which no command
    line can hold), nor `+experiment=a experiment=b` (Hydra runs b alone, without a word): one experiment per
    command, the other's settings given as overrides."""
    chosen = [o for o in overrides if not o.startswith(("++", "~")) and "=" in o and override_key(o) == "experiment"]
    if len(chosen) < 2:
        return None
    other = chosen[-1].partition("=")[2]
    listed = os.path.join("conf", "experiment", f"{other}.yaml")
    where = f" ({listed} lists them)" if os.path.isfile(os.path.join(config_dir, "experiment", f"{other}.yaml")) else ""
    return (f"{' '.join(chosen)}: one experiment per command; keep one ({chosen[0]}) and give the settings you want "
            f"of the other as overrides{where}")


def _deletion_problem(override: str, key: str) -> str | None:
    """Why `~key` cannot delete `key`: a setting of the schema has a value in every run (deleted, a default such as
    run_dir=runs/${name} would be left unresolved). An entry of a mapping (~eval.prompt_sets.gsm8k) can go."""
    if not override.startswith("~") or key.rpartition(".")[0] in ENTRY_SETTINGS:
        return None
    kind = lookup_setting(key)[0]
    if kind is None:
        return None
    return f"{override}: a setting cannot be deleted; give it another value ({key}=...)"


def _null_entry_problem(override: str, key: str, value: str) -> str | None:
    """Why `eval.prompt_sets.gsm8k=null` drops nothing: an entry of a mapping of ENTRY_SETTINGS is a group of
    settings, refused as null once the config is read; `~` drops it."""
    parent = key.rpartition(".")[0]
    if parent not in ENTRY_SETTINGS or override.startswith(("+", "~")) or value.strip().lower() != "null":
        return None
    return f"{override}: an entry of {parent} is dropped, not set to null: ~{key}"


def _loose_bool_problem(key: str, value: str) -> str | None:
    """Why a bool setting cannot take `value`: OmegaConf takes any int as a bool (overwrite=2 as true), which no
    one means; 0 and 1, words, sweeps and interpolations are left to it."""
    number = value.strip()
    if lookup_setting(key)[0] is bool and re.fullmatch(r"[+-]?\d+", number) and number not in ("0", "1"):
        return f"{key}={value}: expected {BOOL_WORDS}"
    return None


def group_options(group: str, config_dir: str) -> list[str]:
    """The options of config group `group`: its YAML files under `config_dir` and its ConfigStore entries ([] for
    none)."""
    from hydra.core.config_store import ConfigStore

    folder = os.path.join(config_dir, group)
    names = os.listdir(folder) if os.path.isdir(folder) else []
    stored = ConfigStore.instance().repo.get(group, {})
    names += list(stored) if isinstance(stored, dict) else []
    return sorted({name[:-len(".yaml")] for name in names if name.endswith(".yaml")})


def unknown_experiment_problem(name: str, config_dir: str) -> str | None:
    """Why `+experiment=name` selects nothing (Hydra's own error names its config 'train' and its search path); a
    sweep `a,b` selects each. Hydra's sweep functions (`choice(a,b)`) are Hydra's to check."""
    known = group_options("experiment", config_dir)
    if not name or "(" in name or all(part in known for part in name.split(",")):
        return None
    return f"+experiment={name}: no such experiment (conf/experiment/ holds {', '.join(known)})"


def refuse_unknown_settings(cfg: DictConfig) -> None:
    """ConfigError naming the first key of the composed config that no setting of its group has."""
    _walk(cfg, "")


def _walk(node: DictConfig, prefix: str) -> None:
    cls = OmegaConf.get_type(node)
    if prefix.rstrip(".") in ENTRY_SETTINGS:
        # A key added to an entry of its own type (+eval.prompt_sets.gsm8k.limt=3) is kept by OmegaConf and dropped
        # when the entry becomes its dataclass; an entry given as a mapping is checked by the schema itself.
        for name in node.keys():
            child = node._get_node(name)
            if isinstance(child, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(child)):
                _walk(child, f"{prefix}{name}.")
        return
    if not dataclasses.is_dataclass(cls):
        return
    fields = {f.name for f in dataclasses.fields(cls)}
    for key in node.keys():
        if key not in fields:
            problem = other_mode_problem(f"{prefix}{key}")  # +capture.cache=false under capture=offline
            raise ConfigError(problem or _no_such(f"{prefix}{key}", prefix.rstrip("."), settings_fields(cls)))
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            _walk(child, f"{prefix}{key}.")


def other_mode_problem(key: str) -> str | None:
    """For a setting of another mode of its group (capture.ranks under capture=offline): the line naming the modes
    that have it (where Hydra asks for a + that would then be refused, or the + added it to a mode without it);
    None for any other key."""
    group, _, name = key.rpartition(".")
    kind = lookup_setting(group)[0] if group else None
    if not dataclasses.is_dataclass(kind) or name in {f.name for f in dataclasses.fields(kind)}:
        return None
    modes = [f"{group}={sub.mode}" for sub in kind.__subclasses__()
             if name in {f.name for f in dataclasses.fields(sub)} and isinstance(getattr(sub, "mode", None), str)]
    if not modes:
        return None
    return (f"{key}: only {' and '.join(modes)} {'has' if len(modes) == 1 else 'have'} this setting, and this "
            f"command runs another {group} mode")


def _no_such(key: str, group: str, fields: dict[str, Any]) -> str:
    name = key.rsplit(".", 1)[-1]
    aliased, note = ALIASES.get(name.lower(), ((), ""))
    # Another trainer's name in the group of our setting, or with no group: ours first. In another group, a close
    # spelling of that group's comes first (eval.output_dir is eval.out_dir, not run_dir).
    ours = [alias for alias in aliased if not group or alias.rpartition(".")[0] == group]
    # A group's setting given without its group (seed=3): the groups that have one of that name.
    owners = [f"{part}.{name}" for part, kind in fields.items()
              if not group and dataclasses.is_dataclass(kind) and name in settings_fields(kind)]
    close = [f"{group}.{near}" if group else near for near in difflib.get_close_matches(name, list(fields), n=1)]
    near = [*ours, *(owner for owner in owners if owner not in ours)] or close or list(aliased)
    meant = ", ".join(near[:-1]) + f" or {near[-1]}" if len(near) > 1 else "".join(near)
    note = f", {note}" if note and set(near) & set(aliased) else ""
    hint = f" (did you mean {meant}{note}?)" if meant else ""
    return f"{key}: no such setting{hint}; the command's --help lists the groups, docs/config.md every key"

"""Keys that name no setting, refused in one line with the nearest setting's name: in a command's overrides (before
Hydra, whose own error for `train.lrr=0.1` takes eight lines) and in a composed config (Hydra adds `+train.lrr=0.1`
without a word, and the run would go on without the learning rate its user meant to set)."""

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
    `config_dir`/experiment/ does not hold, that deletes a setting, or that gives a bool setting an int other than 0
    or 1. Hydra's flags and their values (`--cfg job`) are not overrides: an
    override sets (`key=value`) or deletes (`~key`)."""
    for override in overrides:
        if override.startswith("-") or ("=" not in override and not override.startswith("~")):
            continue
        key, value = override_key(override), override.partition("=")[2]
        problem = unknown_key_problem(key) if key != "experiment" else unknown_experiment_problem(value, config_dir)
        if problem is None and key.split(".")[0] not in NOT_SETTINGS:
            problem = _deletion_problem(override, key) or _loose_bool_problem(key, value)
        if problem is not None:
            raise ConfigError(problem)


def _deletion_problem(override: str, key: str) -> str | None:
    """Why `~key` cannot delete `key`: a setting of the schema has a value in every run (deleted, a default such as
    run_dir=runs/${name} would be left unresolved). An entry of a mapping (~eval.prompt_sets.gsm8k) can go."""
    if not override.startswith("~") or key.rpartition(".")[0] in ENTRY_SETTINGS:
        return None
    kind = lookup_setting(key)[0]
    if kind is None:
        return None
    return f"{override}: a setting cannot be deleted; give it another value ({key}=...)"


def _loose_bool_problem(key: str, value: str) -> str | None:
    """Why a bool setting cannot take `value`: OmegaConf takes any int as a bool (overwrite=2 as true), which no
    one means; 0 and 1, words, sweeps and interpolations are left to it."""
    number = value.strip()
    if lookup_setting(key)[0] is bool and re.fullmatch(r"[+-]?\d+", number) and number not in ("0", "1"):
        return f"{key}={value}: expected true or false"
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
    """Why `+experiment=name` selects nothing (Hydra's own error names its config 'train' and its search path)."""
    known = group_options("experiment", config_dir)
    if not name or name in known:
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
    # A group's setting given without its group (seed=3): the groups that have one of that name.
    owners = [f"{part}.{name}" for part, kind in fields.items()
              if not group and dataclasses.is_dataclass(kind) and name in settings_fields(kind)]
    near = owners or difflib.get_close_matches(name, list(fields), n=1)
    meant = ", ".join(near[:-1]) + f" or {near[-1]}" if len(near) > 1 else "".join(near)
    hint = f" (did you mean {group + '.' if group else ''}{meant}?)" if meant else ""
    return f"{key}: no such setting{hint}; `python -m dflash.train --help` lists the groups, docs/config.md every key"

"""Hydra's own command-line flags, as its argument parser reads them (hydra/_internal/utils.py get_args_parser).

Overrides are the parser's positional arguments: they must all come before the first flag or all after the last
one (`a=1 --cfg job b=2` is refused), so an override the commands add goes before every flag.
"""

from __future__ import annotations

# Every flag, the short and the long form.
HYDRA_FLAGS = ("-h", "--help", "--hydra-help", "--version", "-c", "--cfg", "--resolve", "-p", "--package",
               "-i", "--info", "-m", "--multirun", "-cp", "--config-path", "-cn", "--config-name", "-cd",
               "--config-dir", "--experimental-rerun", "-sc", "--shell-completion", "--run", "-r")
# The flags that each say what the command does, of which it takes one (its _run_hydra raises a traceback).
MODE_FLAGS = {"--run": "-r", "--multirun": "-m", "--cfg": "-c", "--info": "-i", "--shell-completion": "-sc"}


def full_flag(arg: str) -> str | None:
    """The Hydra flag `arg` gives (`--cfg=job` -> --cfg, `--hel` -> --help: the parser takes a long flag's
    unambiguous beginning), or None where it gives none."""
    flag = arg.split("=", 1)[0]
    if flag in HYDRA_FLAGS:
        return flag
    expanded = [f for f in HYDRA_FLAGS if f.startswith(flag)] if flag.startswith("--") and len(flag) > 2 else []
    return expanded[0] if len(expanded) == 1 else None


def flag_arguments(argv: list[str]) -> list[str]:
    """The arguments of `argv` that are flags or their values (`--cfg job`, `-p train`, `--info config`), in their
    order; an override is key=value, +key=value or ~key, and a flag's value is none of these."""
    flags = []
    for index, arg in enumerate(argv):
        follows_flag = index > 0 and argv[index - 1].startswith("-") and "=" not in argv[index - 1]
        if arg.startswith("-") or (follows_flag and "=" not in arg and not arg.startswith("~")):
            flags.append(arg)
    return flags


def before_flags(argv: list[str], *added: str) -> list[str]:
    """`argv` with the overrides `added` after its own overrides and before its flags."""
    flags = flag_arguments(argv)
    return [*(a for a in argv if a not in flags), *added, *flags]

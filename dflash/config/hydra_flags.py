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
# The flags that take the next argument as their value; --info takes it where it is one of its topics.
VALUE_FLAGS = ("-c", "--cfg", "-p", "--package", "-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir",
               "--experimental-rerun")
INFO_TOPICS = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")


def full_flag(arg: str) -> str | None:
    """The Hydra flag `arg` gives (`--cfg=job` -> --cfg, `--hel` -> --help: the parser takes a long flag's
    unambiguous beginning), or None where it gives none."""
    flag = arg.split("=", 1)[0]
    if flag in HYDRA_FLAGS:
        return flag
    expanded = [f for f in HYDRA_FLAGS if f.startswith(flag)] if flag.startswith("--") and len(flag) > 2 else []
    return expanded[0] if len(expanded) == 1 else None


def split_arguments(argv: list[str]) -> tuple[list[str], list[str]]:
    """(overrides, flags): the arguments of `argv` that are overrides, and those that are Hydra's flags or a flag's
    value (`--cfg job`, `-p train`, `--info config`), each in their order. Read by position as the parser reads
    them: VALUE_FLAGS take the next argument, `--info` one of its INFO_TOPICS, the others none."""
    taken: set[int] = set()
    index = 0
    while index < len(argv):
        arg = argv[index]
        if arg.startswith("-"):
            taken.add(index)
            flag, value = full_flag(arg), argv[index + 1] if index + 1 < len(argv) else None
            if "=" not in arg and value is not None and not value.startswith("-") and (
                    flag in VALUE_FLAGS or (flag in ("-i", "--info") and value in INFO_TOPICS)):
                taken.add(index + 1)
                index += 1
        index += 1
    return ([a for i, a in enumerate(argv) if i not in taken], [a for i, a in enumerate(argv) if i in taken])


def before_flags(argv: list[str], *added: str) -> list[str]:
    """`argv` with the overrides `added` after its own overrides and before its flags."""
    overrides, flags = split_arguments(argv)
    return [*overrides, *added, *flags]

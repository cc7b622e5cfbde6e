"""Print the reference table of every setting (docs/config.md holds it), or the settings of the keys given.

    python -m dflash.config                     # every setting, as docs/config.md holds it (Markdown)
    python -m dflash.config train.lr data       # train.lr, and every data.* setting
"""

import sys

from dflash.config.reference import describe, reference

USAGE = ("usage: python -m dflash.config [KEY ...]: every setting, or those whose key is KEY or begins with it "
         "(train.lr, data); `python -m dflash.train --help` shows the training command's main keys")


def refusal(asked: str) -> str | None:
    """Why an argument is no key to look up (a flag, an override), or None."""
    if asked.startswith("-"):
        return f"{asked}: no such option; {USAGE}"
    if "=" in asked:
        return f"{asked}: this command takes keys, not overrides: python -m dflash.config {asked.split('=')[0]}"
    return None


def main(arguments: list[str]) -> None:
    if arguments in (["--help"], ["-h"]):
        print(USAGE)
        return
    if not arguments:
        print(reference())
        return
    described = []
    for asked in arguments:  # every key is checked before anything is printed
        problem = refusal(asked)
        try:
            described.append(describe(asked) if problem is None else None)
        except ValueError as error:
            problem = str(error)
        if problem is not None:
            print(f"dflash: error: {problem}", file=sys.stderr)
            sys.exit(2)
    print("\n".join(described))


main(sys.argv[1:])

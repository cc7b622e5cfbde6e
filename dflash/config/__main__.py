"""Print the reference table of every setting (docs/config.md holds it), or the settings of the keys given.

    python -m dflash.config                     # every setting, as docs/config.md holds it (Markdown)
    python -m dflash.config train.lr data       # train.lr, and every data.* setting
"""

import sys

from dflash.config.reference import describe, reference

if not sys.argv[1:]:
    print(reference())
for asked in sys.argv[1:]:
    if asked.startswith("-"):
        sys.exit("usage: python -m dflash.config [KEY ...]  (every setting, or those whose key is or begins with "
                 "KEY: train.lr, data; `python -m dflash.train --help` shows the training command's)")
    try:
        print(describe(asked))
    except ValueError as error:
        print(f"dflash: error: {error}", file=sys.stderr)
        sys.exit(2)

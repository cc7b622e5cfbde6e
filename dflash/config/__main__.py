"""Print the reference table of every setting (docs/config.md holds it).

    python -m dflash.config
"""

import sys

from dflash.config.reference import reference

if sys.argv[1:]:
    sys.exit("usage: python -m dflash.config  (prints the reference of every setting, as docs/config.md holds it; it "
             "takes no arguments: `python -m dflash.train --help` shows the training command's)")
print(reference())

"""Print the reference table of every setting (docs/config.md holds it).

    python -m dflash.config
"""

from dflash.config.reference import reference

print(reference())

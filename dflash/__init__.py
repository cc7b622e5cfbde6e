"""DFlash: training speculative-decoding drafters for a frozen target (python -m dflash.train)."""

from dflash.console import show_package_messages

show_package_messages()

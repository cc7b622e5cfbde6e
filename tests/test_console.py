"""The console copy of a command (dflash/console.py)."""

import sys

from dflash.console import console_copied_to


def test_what_is_printed_reaches_the_console_and_the_log(tmp_path, capsys):
    path = tmp_path / "logs" / "run.log"
    with console_copied_to(str(path)):
        print("[data] stage took 1.0 s")
        print("dflash: warning: x", file=sys.stderr)
        sys.stderr.write("\r 40%|####      | 4/10")  # a progress bar redrawn: not a line of the log
    print("after")  # no longer copied
    captured = capsys.readouterr()
    assert "[data] stage took 1.0 s" in captured.out and "dflash: warning: x" in captured.err
    assert path.read_text() == "[data] stage took 1.0 s\ndflash: warning: x\n"

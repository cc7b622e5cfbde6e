"""A stop signal (dflash/train/stop_signal.py) that arrives while the last step's checkpoint is saved still stops
training: that step is kept and the run ends with TrainingStopped, on every rank, instead of going on to export."""

from __future__ import annotations

import json
import os
import signal

import pytest

from dflash.train.checkpoint_policy import CheckpointPolicy
from dflash.train.checkpoints import latest_tag
from dflash.train.stop_signal import TrainingStopped
from tests import trainer_harness
from tests.forked import run_ranks
from tests.scripted_clock import budget_run

STEPS = 6  # budget_run and trainer_harness.run(1, 1) on 2 ranks: 3 steps per epoch, 2 epochs, saved at the last only


def signal_while_saving(monkeypatch: pytest.MonkeyPatch, sig: signal.Signals = signal.SIGTERM) -> None:
    """Every checkpoint save ends with `sig` to this process, received through the loop's handler."""
    save = CheckpointPolicy.save
    before = signal.getsignal(sig)

    def save_then_signal(self, engine, step, budget):
        save(self, engine, step, budget)
        if signal.getsignal(sig) is before:
            pytest.fail(f"the loop's {sig.name} handler is not installed")
        signal.raise_signal(sig)

    monkeypatch.setattr(CheckpointPolicy, "save", save_then_signal)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "ctrl-c"])
def test_a_signal_while_the_last_step_is_saved_stops_with_that_step_kept(tmp_path, monkeypatch, sig):
    before = signal.getsignal(sig)
    signal_while_saving(monkeypatch, sig)
    with pytest.raises(TrainingStopped, match=f"by {sig.name} after step {STEPS}"):
        budget_run(tmp_path, None, epochs=2)
    assert latest_tag(str(tmp_path / "checkpoints")) == f"step{STEPS}"
    assert signal.getsignal(sig) is before  # the loop's handler is gone with the loop


def rank_signalled_while_saving(out: str) -> None:
    """One rank of test_a_signal_on_one_rank_while_saving_stops_every_rank's job (tests/forked.py's run_ranks): rank
    1 alone receives the signal; each rank records how its training ended."""
    rank = int(os.environ["RANK"])
    if rank == 1:
        signal_while_saving(pytest.MonkeyPatch())
    try:
        trainer_harness.run(out, 1, 1)
        ended = {"stopped": None}
    except TrainingStopped as stopped:
        ended = {"stopped": stopped.step, "signal": stopped.signal_name}
    with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(ended, f)


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_signal_on_one_rank_while_saving_stops_every_rank(tmp_path):
    assert run_ranks(rank_signalled_while_saving, 2, str(tmp_path)) == [0, 0]
    ended = [json.loads((tmp_path / f"rank{rank}.json").read_text(encoding="utf-8")) for rank in (0, 1)]
    assert ended == [{"stopped": STEPS, "signal": "a signal on another rank"}, {"stopped": STEPS, "signal": "SIGTERM"}]
    assert latest_tag(str(tmp_path / "checkpoints")) == f"step{STEPS}"


def test_ctrl_c_stops_after_the_step_and_twice_stops_at_once(capsys):
    from dflash.train.stop_signal import StopSignal

    previous = signal.getsignal(signal.SIGINT)
    with StopSignal() as stop:
        signal.raise_signal(signal.SIGINT)
        assert stop.received == "SIGINT"  # noted for the loop, which saves the step in flight and stops
        assert "Ctrl-C: stopping after this step, which is saved" in capsys.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is previous


def test_a_sigint_the_process_ignores_stays_ignored_and_other_ranks_say_nothing(capsys, monkeypatch):
    """`nohup cmd &` starts a process with SIGINT ignored: a Ctrl-C meant for the script that started it must not
    stop this run. Only rank 0 says what a Ctrl-C does."""
    from dflash.train.stop_signal import StopSignal

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopSignal() as stop:
            signal.raise_signal(signal.SIGINT)
            assert stop.received is None and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    monkeypatch.setenv("RANK", "1")
    with StopSignal() as stop:
        signal.raise_signal(signal.SIGINT)
    assert stop.received == "SIGINT" and capsys.readouterr().err == ""

"""This rank's micro-batches of each step, the next step's made while the GPU still runs this step's backward
(train.prepare_ahead).

A step's host work ends in a wait for the GPU: DeepSpeed's optimizer step reads whether the gradients' norm is
finite, so the host waits there until the backward it launched has run (docs/training.md has the GPU default's
figures), and after it the GPU waits for the host to make the next batch (features read back or captured, anchors,
labels) and launch its forward. Making the next step's micro-batches between the last backward and the
optimizer step fills that wait with work the next step needs: they depend on the data plan and the step number
alone, never on the drafter's weights. A batch made ahead for a step the run does not reach (a stop, the time
budget) is dropped; the same step made again gives the same batch.

The features' deferred checks keep their order: after a step the loop reads the checks of that step's batches and
leaves the ones made ahead pending (FeatureSource.verify_features(leave=...)), so a bad feature still stops the
run after the step that trained on it is done and before it is logged.
"""

from __future__ import annotations

from collections.abc import Callable


class StepBatches:
    """`of(step)`: the micro-batches of step `step` (0-based: the step after `step` steps), made ahead when
    `make_ahead(step, total_steps)` was called for it, else made now by `make(step)`. ahead=False: nothing is made
    ahead (a source whose micro-batches must be taken in their own step: capture=online)."""

    def __init__(self, make: Callable[[int], list[dict]], ahead: bool) -> None:
        self.make, self.ahead = make, ahead
        self.made: tuple[int, list[dict]] | None = None

    def of(self, step: int) -> list[dict]:
        made, self.made = self.made, None
        return made[1] if made is not None and made[0] == step else self.make(step)

    def make_ahead(self, step: int, total_steps: int) -> None:
        """Make step `step`'s micro-batches now, when the run plans that step (`step` < total_steps)."""
        if self.ahead and step < total_steps:
            self.made = (step, self.make(step))

    @property
    def pending(self) -> int:
        """The micro-batches made ahead and not yet trained on."""
        return 0 if self.made is None else len(self.made[1])

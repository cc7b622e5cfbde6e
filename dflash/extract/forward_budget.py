"""How many tokens one capture forward takes: `capture.batch_tokens`, halved for the rest of the capture each time
a forward of that many runs out of GPU memory.

A capture that runs out of memory hours in would otherwise end, and the usual way on, a smaller
`capture.batch_tokens`, changes the capture's settings, so the rerun would set the partial store aside and start
again. Each sample's features do not depend on which samples share its forward (packed samples see only
themselves; padded ones only their own tokens), up to the kernels' rounding, as between packed and padded capture.
So the forward that failed is planned again in smaller pieces, and the capture goes on.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


class SampleTooLarge(RuntimeError):
    """One sample alone does not fit a forward of the target on its device."""


class ForwardBudget:
    """The tokens a capture forward may take, shared by every forward of one capture process."""

    def __init__(self, batch_tokens: int) -> None:
        if batch_tokens < 1:
            raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
        self.tokens = batch_tokens

    def fits(self, forward: Callable[[], None], tokens: int, lone_sample: str | None) -> bool:
        """Run `forward` (a forward of `tokens` tokens; `lone_sample`: the sample it holds, where it holds one):
        True when it ran, False when it ran out of device memory and the budget is now half of `tokens` (plan the
        rest again). SampleTooLarge where a lone sample does not fit."""
        try:
            forward()
            return True
        except torch.OutOfMemoryError as error:
            if lone_sample is not None:
                raise SampleTooLarge(
                    f"sample {lone_sample} ({tokens:,} tokens) does not fit one forward of the target on its device "
                    f"even alone: lower data.max_length, or spread the target over more GPUs "
                    f"(capture.gpus_per_worker)") from error
        # Here, past the handler, the failed forward's tensors are released with its traceback.
        release_device_memory()
        self.tokens = max(1, min(self.tokens, tokens) // 2)
        logger.warning(f"[capture] warning: a forward of {tokens:,} tokens ran out of device memory: "
                       f"{self.tokens:,} tokens a forward from here on (the features are the same)")
        return False


def release_device_memory() -> None:
    """After a forward that ran out of device memory, once its traceback is gone: what it held (a reference cycle
    through its frames included) goes back to the device."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

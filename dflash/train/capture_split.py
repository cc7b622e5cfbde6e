"""The capture:trainer device split that balances online capture's two rates, from a run's measured counters
(reported at the end of training, in capture_logs/throughput.json and on the console)."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def log_split(report: dict) -> None:
    """The split_advice report's balanced split, as one console line."""
    share, (capture_devices, trainer_devices) = report["balanced_capture_fraction"], report["balanced_split"]
    logger.info(f"[online] balanced capture:trainer device split: {share:.2f}:{1 - share:.2f}, i.e. "
                f"{capture_devices}:{trainer_devices} of these {capture_devices + trainer_devices} devices")


def split_advice(capture_rate: float, trainer_rate: float, capture_devices: int, trainer_ranks: int) -> dict:
    """The capture:trainer device split that balances the two rates (tokens/s per device): capture devices x
    capture rate = trainer devices x trainer rate, rounded within the devices in use (at least one each)."""
    total = capture_devices + trainer_ranks
    share = trainer_rate / (trainer_rate + capture_rate)
    balanced = min(max(round(total * share), 1), total - 1) if total > 1 else 1
    return {"capture_tokens_per_s_per_device": capture_rate, "trainer_tokens_per_s_per_rank": trainer_rate,
            "capture_devices": capture_devices, "trainer_ranks": trainer_ranks, "balanced_capture_fraction": share,
            "balanced_split": [balanced, total - balanced]}

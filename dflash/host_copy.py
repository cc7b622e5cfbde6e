"""Host-to-device copies that do not make the host wait for the device."""

from __future__ import annotations

import torch


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`, without waiting for the device: a copy from pageable memory to a GPU makes the
    host wait until the stream has finished everything queued before it; from page-locked memory it is queued.
    A tensor already on a device is moved as it is."""
    if torch.device(device).type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)

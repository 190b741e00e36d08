"""Which CUDA device a rank uses: ``resilient.init()`` selects it before the group is
made, so that everything CUDA the group opens (its GPU health watch, its links) is
that device's.

The rule: the device the user named (``init(device_id=...)``), else ``cuda:LOCAL_RANK``.
A LOCAL_RANK with no GPU of its own is an error under NCCL links (NCCL takes one GPU
per rank); with ``RESILIENT_CUDA_TRANSPORT=socket`` (CUDA tensors staged through host
memory) ranks may share GPUs, and local rank ``r`` takes GPU ``r mod count``.
"""

from __future__ import annotations

import logging

import torch

from resilient.config import DataPlaneConfig, local_rank_env
from resilient.errors import ConfigError

__all__ = ["select_device"]

logger = logging.getLogger(__name__)


def select_device(
    device_id: torch.device | int | str | None, config: DataPlaneConfig
) -> torch.device | None:
    """Make this rank's CUDA device current (``torch.cuda.set_device``) and return it;
    None without CUDA, or when ``device_id`` names a device that is not CUDA.

    Raises:
        ConfigError: LOCAL_RANK is malformed or negative, or names no visible GPU
            while CUDA tensors take NCCL links (the message names LOCAL_RANK, the
            number of GPUs and CUDA_VISIBLE_DEVICES).
    """
    if not torch.cuda.is_available():
        return None
    if device_id is not None:
        device = (
            torch.device("cuda", device_id)
            if isinstance(device_id, int)
            else torch.device(device_id)
        )
        if device.type != "cuda":
            return None
        torch.cuda.set_device(device)
        logger.info("rank's CUDA device: %s (init's device_id)", device)
        return device
    local_rank, visible = local_rank_env()
    count = torch.cuda.device_count()
    if local_rank < 0:
        raise ConfigError(f"LOCAL_RANK={local_rank}: must be >= 0")
    index = local_rank
    if local_rank >= count:
        if config.cuda_transport != "socket":
            raise ConfigError(
                f"LOCAL_RANK={local_rank} but this process sees {count} CUDA device(s) "
                f"(CUDA_VISIBLE_DEVICES={visible if visible is not None else 'unset'}): "
                "NCCL links need one GPU per rank. Start at most that many ranks per node, "
                "or let ranks share GPUs with RESILIENT_CUDA_TRANSPORT=socket, or name the "
                "device with resilient.init(device_id=...)"
            )
        index = local_rank % count
    torch.cuda.set_device(index)
    logger.info(
        "local rank %d: CUDA device cuda:%d of %d (CUDA_VISIBLE_DEVICES=%s)%s",
        local_rank, index, count, visible, "" if index == local_rank else ", shared",
    )  # fmt: skip
    return torch.device("cuda", index)

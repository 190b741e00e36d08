"""resilient.init() makes cuda:LOCAL_RANK current, or the device the user named; a
LOCAL_RANK with no GPU is a clear error under NCCL links and shares under socket
links. torch.cuda's answers are the test's (no GPU needed)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import resilient
from resilient.config import DataPlaneConfig
from resilient.errors import ConfigError
from resilient.group.cuda_device import select_device

pytestmark = pytest.mark.timeout(10)

NCCL = DataPlaneConfig()
SOCKET = DataPlaneConfig(cuda_transport="socket")


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    """A host with two visible GPUs (CUDA_VISIBLE_DEVICES=2,3); the devices set."""
    set_to: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: set_to.append(torch.device("cuda", d)))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    return set_to


def test_local_rank_picks_its_gpu(
    cuda: list[torch.device], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert select_device(None, NCCL) == torch.device("cuda", 1)
    monkeypatch.delenv("LOCAL_RANK")
    assert select_device(None, NCCL) == torch.device("cuda", 0)
    assert cuda == [torch.device("cuda", 1), torch.device("cuda", 0)]


def test_too_few_gpus_for_nccl_links_is_a_clear_error(
    cuda: list[torch.device], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ConfigError) as err:
        select_device(None, NCCL)
    text = str(err.value)
    assert "LOCAL_RANK=2" in text and "2 CUDA device(s)" in text
    assert "CUDA_VISIBLE_DEVICES=2,3" in text and "RESILIENT_CUDA_TRANSPORT=socket" in text
    assert cuda == []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES=unset"):
        select_device(None, NCCL)
    monkeypatch.setenv("LOCAL_RANK", "-1")
    with pytest.raises(ConfigError, match="LOCAL_RANK=-1"):
        select_device(None, NCCL)
    monkeypatch.setenv("LOCAL_RANK", "one")
    with pytest.raises(ConfigError, match="LOCAL_RANK"):
        select_device(None, NCCL)


def test_socket_links_let_ranks_share_gpus(
    cuda: list[torch.device], monkeypatch: pytest.MonkeyPatch
) -> None:
    for local_rank in range(5):
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        select_device(None, SOCKET)
    assert [d.index for d in cuda] == [0, 1, 0, 1, 0]


def test_the_device_the_user_named_wins(
    cuda: list[torch.device], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "7")  # would be an error, but the user chose
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: cuda.append(torch.device(d)))
    assert select_device(torch.device("cuda", 1), NCCL) == torch.device("cuda", 1)
    assert select_device(0, NCCL) == torch.device("cuda", 0)
    assert select_device("cpu", NCCL) is None
    assert cuda == [torch.device("cuda", 1), torch.device("cuda", 0)]


def test_without_cuda_nothing_is_selected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "9")
    assert select_device(None, NCCL) is None


def test_init_selects_the_device_before_the_group_is_made(
    cuda: list[torch.device], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not dist.is_initialized()
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.delenv("RESILIENT_CUDA_TRANSPORT", raising=False)
    made: list[str] = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: made.append(backend))
    with pytest.raises(ConfigError, match="LOCAL_RANK=3"):
        resilient.init()
    assert made == [] and cuda == []
    monkeypatch.setenv("RESILIENT_CUDA_TRANSPORT", "socket")
    with pytest.raises(RuntimeError, match="not the resilient one"):
        resilient.init()  # the stub made no group; the device was set before it
    assert made == ["resilient"] and cuda == [torch.device("cuda", 1)]


def test_cuda_transport_is_read_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert DataPlaneConfig.from_env({}).cuda_transport == "nccl"
    assert DataPlaneConfig.from_env({"RESILIENT_CUDA_TRANSPORT": " Socket "}).cuda_transport == (
        "socket"
    )
    with pytest.raises(ConfigError, match="cuda_transport='pcie'"):
        DataPlaneConfig.from_env({"RESILIENT_CUDA_TRANSPORT": "pcie"})

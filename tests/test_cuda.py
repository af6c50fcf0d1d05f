"""CUDA and NCCL paths: run where GPUs exist, skip cleanly where they do not."""

import pytest
import torch

import moirai
from moirai.runtime.distributed import backend_for

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


class Chain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).relu()


def test_backend_choice() -> None:
    assert backend_for(["cpu", "cpu"]) == "gloo"
    assert backend_for(["cuda:0", "cuda:1"]) == "nccl"
    assert backend_for(["cuda:0", "cpu"]) == "cpu:gloo,cuda:nccl"


def test_requesting_cuda_without_it_is_a_clear_error() -> None:
    if GPUS:
        pytest.skip("this machine has CUDA")
    with pytest.raises(moirai.ClusterError, match="CUDA is not available"):
        moirai.Cluster.from_devices(["cuda:0", "cpu"])


def _compile_and_check(devices: list[str]) -> None:
    torch.manual_seed(0)
    model = Chain().eval()
    x = torch.randn(8, 64)
    compiled = moirai.compile(model, devices, example_inputs=(x,), placer="round_robin")
    with torch.no_grad():
        expected = model(x)
        torch.testing.assert_close(compiled(x).cpu(), expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(compiled.run_distributed(x).cpu(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device")
def test_cuda_and_cpu_split_over_gloo_and_nccl() -> None:
    _compile_and_check(["cuda:0", "cpu"])


@pytest.mark.skipif(GPUS < 2, reason="needs two CUDA devices")
def test_two_gpus_split_over_nccl() -> None:
    _compile_and_check(["cuda:0", "cuda:1"])


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device")
def test_detect_describes_every_visible_gpu() -> None:
    cluster = moirai.Cluster.detect()
    assert sum(d.torch_device.startswith("cuda") for d in cluster.devices) == GPUS

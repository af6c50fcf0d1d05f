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


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device")
def test_a_server_on_cuda_and_cpu_answers_every_request_as_the_model() -> None:
    torch.manual_seed(0)
    model = Chain().eval()
    requests = [torch.randn(8, 64) for _ in range(12)]
    compiled = moirai.compile(model, ["cuda:0", "cpu"], example_inputs=(requests[0],), placer="round_robin")
    with torch.no_grad(), compiled.server() as server:
        futures = [server.submit(x) for x in requests]
        for x, future in zip(requests, futures, strict=True):
            torch.testing.assert_close(future.result(timeout=120).cpu(), model(x), rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device")
def test_measured_costs_on_cuda_and_cpu_plan_and_run_exactly() -> None:
    """Profiles on the GPU (timed with its synchronize) and the calibrated cpu<->cuda link: milp's plan runs."""
    torch.manual_seed(0)
    model = Chain().eval()
    x = torch.randn(256, 64)
    compiled = moirai.compile(
        model, ["cuda:0", "cpu"], example_inputs=(x,), cost="measured", placer="milp", time_limit_s=5
    )
    assert compiled.plan.makespan_s > 0
    with torch.no_grad():
        torch.testing.assert_close(compiled.run_distributed(x).cpu(), model(x), rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device")
@pytest.mark.parametrize("devices", [["cuda:0", "cpu"], ["cpu", "cuda:0"]])
def test_greedy_tokens_across_cuda_and_cpu_equal_the_models_generate(devices: list[str]) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    lm = moirai.compile_lm(
        model, devices, max_batch_size=2, max_seq_len=64, max_prefill=8, placer="round_robin", calibration="none"
    )
    assert len(set(lm.compiled.plan.placement.tolist())) == 2, "the test needs a plan on both devices"
    prompt = torch.randint(0, 512, (2, 19), generator=torch.Generator().manual_seed(1))  # 19 > max_prefill = 8
    with torch.no_grad():
        expected = model.generate(prompt, max_new_tokens=24, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert torch.equal(lm.generate(prompt, max_new_tokens=24).cpu(), expected)
    with lm.server() as server:
        assert server.submit(prompt[0], max_new_tokens=8).result(timeout=120) == expected[0, 19:27].tolist()

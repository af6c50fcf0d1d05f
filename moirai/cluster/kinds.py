"""Device kinds (``cpu``, ``cuda``): everything the cost model, the runtime and calibration ask about a kind of device.

Code that needs to synchronise a device, pick a process-group backend, decide where a message between two
ranks lives, or detect the devices of a machine asks :func:`kind_of` instead of testing for ``"cuda"``.
Supporting another kind (MPS, XPU) is one more :class:`DeviceKind` in :data:`KINDS`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moirai.errors import ClusterError


@dataclass(frozen=True)
class DeviceKind:
    """One kind of torch device; the base class is the host CPU."""

    name: str = "cpu"  # torch.device(...).type
    accelerator: bool = False  # a "gpu" in the cluster model: own memory, fed over a link
    backend: str = "gloo"  # torch.distributed backend between ranks of this kind
    messages_in_device_memory: bool = False  # ranks of this kind exchange tensors without staging through the host

    def count(self) -> int:
        """How many devices of this kind this machine has."""
        return 1

    def available(self, device: torch.device) -> bool:
        """Whether ``device`` exists on this machine."""
        return True

    def synchronize(self, device: torch.device) -> None:
        """Wait until the work queued on ``device`` is done (a no-op where work runs as it is called)."""

    def set_current(self, device: torch.device) -> None:
        """Make ``device`` the process's current device of its kind (before joining a process group)."""

    def can_access_peer(self, a: int, b: int) -> bool:
        """Whether devices ``a`` and ``b`` of this kind reach each other's memory directly."""
        return False

    def hardware_name(self, device: torch.device) -> str | None:
        """The product name of ``device``, or None where the caller knows better (the CPU model)."""
        return None

    def properties(self, index: int) -> Any:
        """The driver's description of device ``index`` (memory, multiprocessors), where it has one."""
        raise ClusterError(f"no device properties for kind {self.name!r}")


@dataclass(frozen=True)
class CudaKind(DeviceKind):
    name: str = "cuda"
    accelerator: bool = True
    backend: str = "nccl"
    messages_in_device_memory: bool = True

    def count(self) -> int:
        return torch.cuda.device_count()

    def available(self, device: torch.device) -> bool:
        return (device.index or 0) < torch.cuda.device_count()

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def set_current(self, device: torch.device) -> None:
        torch.cuda.set_device(device)

    def can_access_peer(self, a: int, b: int) -> bool:
        return torch.cuda.can_device_access_peer(a, b)

    def hardware_name(self, device: torch.device) -> str | None:
        return torch.cuda.get_device_name(device.index or 0)

    def properties(self, index: int) -> Any:
        return torch.cuda.get_device_properties(index)


CPU = DeviceKind()
CUDA = CudaKind()
KINDS: dict[str, DeviceKind] = {kind.name: kind for kind in (CPU, CUDA)}


def kind_of(device: str | torch.device) -> DeviceKind:
    """The kind of ``device`` (``"cuda:1"``, ``torch.device("cpu")``)."""
    device_type = torch.device(device).type
    try:
        return KINDS[device_type]
    except KeyError:
        raise ClusterError(
            f"unsupported device {str(device)!r}; moirai knows {', '.join(f'{k}[:N]' for k in KINDS)}"
        ) from None


def accelerator_kinds() -> tuple[DeviceKind, ...]:
    """Every accelerator kind, for detection."""
    return tuple(kind for kind in KINDS.values() if kind.accelerator)


def kind_for_backend(backend: str) -> DeviceKind:
    """The device kind whose ranks talk over ``backend`` (``"gloo"``: CPU, ``"nccl"``: CUDA)."""
    for kind in KINDS.values():
        if kind.backend == backend:
            return kind
    raise ClusterError(f"unknown backend {backend!r}; choose one of {sorted({k.backend for k in KINDS.values()})}")


def backend_for(torch_devices: Sequence[str | torch.device]) -> str:
    """The process-group backend of a world with these devices: one backend when every rank is of one kind,
    else one per kind (``"cpu:gloo,cuda:nccl"``) so torch dispatches each message by its tensor's device."""
    kinds = sorted({kind_of(d) for d in torch_devices}, key=lambda kind: kind.name)
    if len(kinds) == 1:
        return kinds[0].backend
    return ",".join(f"{kind.name}:{kind.backend}" for kind in kinds)

"""The fitted costs of calibration: a directed link's :class:`TransferCost` from its timings, per link kind."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np
import torch

from moirai.errors import ClusterError


@dataclasses.dataclass(frozen=True)
class TransferCost:
    """What one message over a directed link costs inside the runtime, as fitted lines in its size.

    ``latency_s + bytes / bandwidth_bytes_per_s``: from the send call to the blocked receiver
    holding the tensor. ``sender_cpu_s + bytes * sender_cpu_s_per_byte`` (and the receiver's):
    CPU time the transfer takes from that end's process.
    """

    latency_s: float
    bandwidth_bytes_per_s: float
    sender_cpu_s: float
    sender_cpu_s_per_byte: float
    receiver_cpu_s: float
    receiver_cpu_s_per_byte: float

    def delay_s(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s

    def sender_cpu_time_s(self, num_bytes: float) -> float:
        return self.sender_cpu_s + num_bytes * self.sender_cpu_s_per_byte

    def receiver_cpu_time_s(self, num_bytes: float) -> float:
        return self.receiver_cpu_s + num_bytes * self.receiver_cpu_s_per_byte


class NoisyTimingsError(ClusterError):
    """A link's timings that no line fits (a delay that does not grow with the message's size): noise of the
    moment, such as another process's burst on the cores while they were taken, which measuring again may not meet."""


@dataclasses.dataclass(frozen=True)
class TransferTimings:
    """Per message size, the medians over the repeats of one directed link's three measurements."""

    sizes_bytes: tuple[int, ...]
    delay_s: tuple[float, ...]
    sender_cpu_s: tuple[float, ...]
    receiver_cpu_s: tuple[float, ...]
    # Between hosts: the rate messages of the largest size sent back to back crossed at (None: not measured).
    stream_bytes_per_s: float | None = None
    # The median share of its core the sender ran while it computed between messages (None: not measured): below 1,
    # other processes took turns on it ([Note: a calibration on a busy machine]).
    core_share: float | None = None

    def fit(self) -> TransferCost:
        latency, seconds_per_byte = fit_line(self.sizes_bytes, self.delay_s, "transfer delay")
        if not seconds_per_byte > 0:
            raise NoisyTimingsError(
                f"transfer delay does not grow with size (slope {seconds_per_byte:.3g} s/byte); "
                "the timings are noise: use larger sizes or more repeats"
            )
        # A line fitted to noisy CPU times may dip below zero at one end; no part of a cost is negative.
        sender = [max(x, 0.0) for x in fit_line(self.sizes_bytes, self.sender_cpu_s, "sender CPU time")]
        receiver = [max(x, 0.0) for x in fit_line(self.sizes_bytes, self.receiver_cpu_s, "receiver CPU time")]
        return TransferCost(max(latency, 0.0), 1.0 / seconds_per_byte, *sender, *receiver)


def fit_between_hosts(timings: TransferTimings) -> TransferCost:
    """A link between hosts, fitted so its bandwidth comes from the large messages: a network passes a small message
    in one burst (a switch's buffer, a token bucket) and holds a large one to its rate, which relative residuals,
    set by the many small sizes, miss (a link shaped to 100 Mbit/s fitted at 2.8 Gbit/s). The slope is the plain
    least squares one, or a stream's rate where that is lower ([Note: a stream's bandwidth]); the latency is what
    the smallest message took beyond its bytes at that rate."""
    fitted = timings.fit()
    sizes, delays = np.asarray(timings.sizes_bytes, float), np.asarray(timings.delay_s, float)
    seconds_per_byte = float(np.polyfit(sizes, delays, 1)[0])
    if not seconds_per_byte > 0:
        return fitted
    if timings.stream_bytes_per_s is not None:
        seconds_per_byte = max(seconds_per_byte, 1.0 / timings.stream_bytes_per_s)
    smallest = int(np.argmin(sizes))
    latency = max(float(delays[smallest] - sizes[smallest] * seconds_per_byte), 0.0)
    return dataclasses.replace(fitted, latency_s=latency, bandwidth_bytes_per_s=1.0 / seconds_per_byte)


def fit_line(sizes_bytes: Sequence[float], values_s: Sequence[float], what: str) -> tuple[float, float]:
    """``(fixed_s, s_per_byte)`` of the least-squares line through ``values_s`` at ``sizes_bytes``."""
    sizes, values = np.asarray(sizes_bytes, float), np.asarray(values_s, float)
    if len(sizes) < 2 or np.ptp(sizes) == 0:
        raise ClusterError(f"fitting the {what} needs timings of at least two different message sizes")
    # Relative residuals: small messages (microseconds) set the fixed part as much as large ones
    # (milliseconds) set the slope; plain residuals would leave the fixed part to the large ones' noise.
    weight = 1.0 / np.maximum(np.abs(values), 1e-9)
    design = np.stack([np.ones_like(sizes), sizes], axis=1) * weight[:, None]
    (fixed, per_byte), *_ = np.linalg.lstsq(design, values * weight, rcond=None)
    return float(fixed), float(per_byte)


class HostLink(NamedTuple):
    """A link between the ranks of two hosts (one host: ranks that share its memory), of one :func:`link_kind`."""

    src_host: str
    dst_host: str
    kind: str

    def __str__(self) -> str:
        return f"{self.src_host} -> {self.dst_host} ({self.kind})"


def link_kind(src_torch_device: str, dst_torch_device: str) -> str:
    """The kind of a local link, e.g. ``"cpu->cuda"``: links of one kind cost the same on one host."""
    return f"{torch.device(src_torch_device).type}->{torch.device(dst_torch_device).type}"


def costs_by_kind(
    torch_devices: Sequence[str], costs: Mapping[tuple[int, int], TransferCost]
) -> dict[str, TransferCost]:
    """The costs of the measured pairs of ranks per link kind; pairs of one kind (both directions of
    ``cpu->cpu``) are averaged field by field."""
    pairs_of_kind: dict[str, list[TransferCost]] = {}
    for (a, b), cost in costs.items():
        pairs_of_kind.setdefault(link_kind(torch_devices[a], torch_devices[b]), []).append(cost)
    return {
        kind: TransferCost(*np.mean([dataclasses.astuple(c) for c in same], axis=0).tolist())
        for kind, same in pairs_of_kind.items()
    }

"""Calibrate links: what a transfer costs inside the runtime, per kind of local link.

Two rank processes are set up as the runtime sets up its workers (each pinned to its share of
the cores with as many compute threads, :mod:`moirai.runtime.resources`; the runtime's links: shared
memory between ranks of one host, gloo and NCCL process groups with their I/O threads off the rank's
cores) and move messages with the runtime's own
point-to-point code (staging, receive buffers, tags, waits). For each message the receiver has posted
its receive and is blocked in the wait (as a part waiting for an input is); the sender computes long
enough for it surely to be, reads the clock, sends, computes on for a while, and waits for its send to
finish. The sender computes as a part does around its sends: the I/O threads that move the message
then compete with compute for a core, which a sweep between idle ranks never shows (it measured a
third of the delay a transfer took inside a schedule). Per message, on the one clock of this host:

* **delay**: from the sender's send call to the receiver holding the tensor (woken up);
* **sender CPU time**: CPU time of the sender's process (all its threads, gloo's included)
  in its send call and its wait for the send (not the compute between): time its compute cannot use;
* **receiver CPU time**: CPU time of the receiver's process from posting its receive to the end
  of its blocked wait: the post, waking up, copying the message out (of the ring, or gloo's socket).

The median of the repeats at each size (after warm-up; the runtime sees typical messages, not
the fastest) is fitted as ``fixed + bytes * per_byte`` for each of the three: the delay gives the
link's latency and bandwidth (:class:`TransferCost`). CPU<->CPU and CPU<->GPU links of one host go
through shared memory (:mod:`moirai.runtime.shm`; gloo where it is off), GPU<->GPU over NCCL; all
use this one measurement (the device kind decides where the message lives and whether the clock
reading synchronises the device first).

Example::

    costs = measure_transfer_costs(["cpu", "cpu"])           # {(0, 1): TransferCost, (1, 0): ...}
    cluster = calibrate(world_size=2, output="cluster.toml")  # a cluster file with measured links

``compile`` on local devices reads a cached calibration of this machine (:func:`local_calibration`),
measured the first time a link kind is needed and stored next to the measured profiles.

The modules: :mod:`~.measure` the rank measurement protocol, :mod:`~.fit` the fitted costs,
:mod:`~.request_cost` the runtime's own work per request, :mod:`~.across_hosts` the links between hosts under
torchrun, :mod:`~.cache` this machine's cached calibration (with the links between hosts measured from it),
:mod:`~.cluster` clusters from calibration, :mod:`~.cli` ``moirai calibrate``. They build on the runtime and
the cost model, never on :mod:`moirai.compile`, which calls them.
"""

from moirai.cluster.calibration.across_hosts import HostsCalibration, measure_across_hosts
from moirai.cluster.calibration.cache import (
    CALIBRATION_FORMAT_VERSION,
    calibration_cache_path,
    local_calibration,
    local_host_links,
    local_request_cost,
    read_calibration,
    read_host_links,
    read_request_cost,
    write_calibration,
)
from moirai.cluster.calibration.cluster import calibrate, calibrated_cluster
from moirai.cluster.calibration.fit import (
    HostLink,
    TransferCost,
    TransferTimings,
    costs_by_kind,
    fit_line,
    link_kind,
)
from moirai.cluster.calibration.measure import (
    DEFAULT_SIZES_BYTES,
    measure_link_kinds,
    measure_transfer_costs,
    measure_transfers,
)
from moirai.cluster.calibration.request_cost import (
    MeasuredRequestCost,
    RequestCost,
    measure_request_cost,
    measure_request_cost_spread,
)

__all__ = [
    "CALIBRATION_FORMAT_VERSION",
    "DEFAULT_SIZES_BYTES",
    "HostLink",
    "HostsCalibration",
    "MeasuredRequestCost",
    "RequestCost",
    "TransferCost",
    "TransferTimings",
    "calibrate",
    "calibrated_cluster",
    "calibration_cache_path",
    "costs_by_kind",
    "fit_line",
    "link_kind",
    "local_calibration",
    "local_host_links",
    "local_request_cost",
    "measure_across_hosts",
    "measure_link_kinds",
    "measure_request_cost",
    "measure_request_cost_spread",
    "measure_transfer_costs",
    "measure_transfers",
    "read_calibration",
    "read_host_links",
    "read_request_cost",
    "write_calibration",
]

"""Cluster files, routes, presets and validation (moirai/cluster/devices.py)."""

from __future__ import annotations

import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moirai.cluster.devices import GBPS_IN_BYTES_PER_S, Cluster, Device, Link
from moirai.errors import ClusterError

GBPS = GBPS_IN_BYTES_PER_S
MB = 1e6

TABLE_III_INTER_GBPS = [
    [0, 44.26, 32.92, 44.28],
    [42.39, 0, 35.32, 44.51],
    [33.2, 35.31, 0, 32.95],
    [42.08, 43.22, 33.28, 0],
]
TABLE_III_INTRA_GBPS = [
    [0, 1170.04, 626.10, 610.56],
    [1148.16, 0, 618.98, 581.09],
    [630.43, 609.82, 0, 571.96],
    [622.67, 575.08, 581.35, 0],
]


def cpu(name: str) -> Device:
    return Device(name, "cpu", memory_bytes=1e9, peak_flops=1e11, memory_bandwidth_bytes_per_s=1e10)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(textwrap.dedent(text))
    return path


def two_device_file(link: str = 'src = "a"\ndst = "b"\nbandwidth_gbps = 10\n', device_b: str = "") -> str:
    return (
        '[[devices]]\nname = "a"\ntype = "t4"\n\n'
        f'[[devices]]\nname = "b"\ntype = "p4"\n{device_b}\n'
        f"[[links]]\n{link}both_directions = true\n"
    )


# --- routes ----------------------------------------------------------------------------------


def test_paper_fig3_example_bottleneck_sets_the_time() -> None:
    # Paper §III-C: A-B at 10 MB/s and B-D at 5 MB/s: 100 MB from A to D takes 20 s.
    devices = [cpu(n) for n in "ABD"]
    links = [Link("A", "B", 10 * MB), Link("B", "D", 5 * MB)]
    cluster = Cluster.from_links(devices, links + [Link(x.dst, x.src, x.bandwidth_bytes_per_s) for x in links])
    a, d = cluster.index("A"), cluster.index("D")
    assert cluster.transfer_time_s(100 * MB, a, d) == pytest.approx(20.0)
    assert cluster.route("A", "D") == ("A", "B", "D")


def test_widest_path_wins_over_the_shortest() -> None:
    # s -> t directly is absent; s-x-t has bottleneck 3, s-y-z-t has bottleneck 5 (longer but wider).
    devices = [cpu(n) for n in ("s", "x", "y", "z", "t")]
    links = [
        Link("s", "x", 100 * MB, 1e-6),
        Link("x", "t", 3 * MB, 1e-6),
        Link("s", "y", 5 * MB, 2e-6),
        Link("y", "z", 50 * MB, 3e-6),
        Link("z", "t", 8 * MB, 4e-6),
        Link("t", "s", 1 * MB, 1e-6),
    ]
    cluster = Cluster.from_links(devices, links)
    s, t = cluster.index("s"), cluster.index("t")
    assert cluster.route("s", "t") == ("s", "y", "z", "t")
    assert cluster.bandwidth_bytes_per_s[s, t] == pytest.approx(5 * MB)
    assert cluster.latency_s[s, t] == pytest.approx(9e-6)
    # The way back goes t -> s (1 MB/s) and then on: asymmetric routes are kept.
    assert cluster.route("t", "x") == ("t", "s", "x")
    assert cluster.bandwidth_bytes_per_s[t, cluster.index("x")] == pytest.approx(1 * MB)


def test_among_equally_wide_paths_the_lowest_latency_is_taken() -> None:
    devices = [cpu(n) for n in "sabt"]
    links = [Link("s", "a", MB, 5e-6), Link("a", "t", MB, 5e-6), Link("s", "b", MB, 1e-6), Link("b", "t", MB, 1e-6)]
    links += [Link(x.dst, x.src, x.bandwidth_bytes_per_s, x.latency_s) for x in links]
    cluster = Cluster.from_links(devices, links)
    assert cluster.route("s", "t") == ("s", "b", "t")
    assert cluster.latency_s[0, 3] == pytest.approx(2e-6)


def test_asymmetric_links_stay_asymmetric() -> None:
    cluster = Cluster.from_links([cpu("a"), cpu("b")], [Link("a", "b", 10 * MB, 1e-6), Link("b", "a", 2 * MB, 3e-6)])
    assert cluster.transfer_time_s(10 * MB, 0, 1) == pytest.approx(1 + 1e-6)
    assert cluster.transfer_time_s(10 * MB, 1, 0) == pytest.approx(5 + 3e-6)


def test_a_renamed_cluster_keeps_its_devices_and_links_under_the_new_names() -> None:
    cluster = Cluster.from_links([cpu("a"), cpu("b")], [Link("a", "b", 10 * MB, 1e-6), Link("b", "a", 2 * MB, 3e-6)])
    renamed = cluster.renamed(["x", "y"])
    assert renamed.names == ("x", "y") and renamed.route("x", "y") == ("x", "y")
    assert [(link.src, link.dst, link.bandwidth_bytes_per_s) for link in renamed.links] == [
        ("x", "y", 10 * MB),
        ("y", "x", 2 * MB),
    ]
    np.testing.assert_array_equal(renamed.bandwidth_bytes_per_s, cluster.bandwidth_bytes_per_s)
    with pytest.raises(ClusterError, match="duplicate device names"):
        cluster.renamed(["x", "x"])
    with pytest.raises(ClusterError, match="1 names given for 2 devices"):
        cluster.renamed(["x"])


def test_unreachable_device_is_named() -> None:
    with pytest.raises(ClusterError, match="'c' cannot be reached from 'a'"):
        Cluster.from_links([cpu("a"), cpu("b"), cpu("c")], [Link("a", "b", MB), Link("b", "a", MB), Link("c", "a", MB)])


# --- presets ---------------------------------------------------------------------------------


def test_presets_are_listed() -> None:
    assert {"moirai-inter-server", "moirai-intra-server"} <= set(Cluster.presets())
    assert len(Cluster.presets()) >= 5
    for name in Cluster.presets():
        assert len(Cluster.preset(name)) >= 2


@pytest.mark.parametrize(
    ("preset", "types", "memory_gb", "matrix"),
    [
        ("moirai-inter-server", ["rtx2080ti", "t4", "p4", "rtx3060ti"], [11, 16, 8, 8], TABLE_III_INTER_GBPS),
        ("moirai-intra-server", ["v100", "v100", "p100", "p100"], [32, 32, 16, 16], TABLE_III_INTRA_GBPS),
    ],
)
def test_paper_presets_match_table_iii(preset: str, types: list[str], memory_gb: list[int], matrix: list) -> None:
    cluster = Cluster.preset(preset)
    assert cluster.names == ("A", "B", "C", "D")
    assert [d.device_type for d in cluster.devices] == types
    assert [d.memory_bytes for d in cluster.devices] == [m * 1e9 for m in memory_gb]
    expected = np.array(matrix, float) * GBPS
    off_diagonal = ~np.eye(4, dtype=bool)
    np.testing.assert_allclose(cluster.bandwidth_bytes_per_s[off_diagonal], expected[off_diagonal], rtol=1e-12)
    # Table III is a full mesh: no pair is routed.
    assert all(len(cluster.route(a, b)) == 2 for a in cluster.names for b in cluster.names if a != b)


def test_inter_server_preset_is_asymmetric_and_on_four_hosts() -> None:
    cluster = Cluster.preset("moirai-inter-server")
    assert cluster.bandwidth_bytes_per_s[0, 1] == pytest.approx(44.26 * GBPS)
    assert cluster.bandwidth_bytes_per_s[1, 0] == pytest.approx(42.39 * GBPS)
    assert len({d.host for d in cluster.devices}) == 4
    assert [d.rank for d in cluster.devices] == [0, 1, 2, 3]


def test_our_presets_route_through_the_host_and_the_nic() -> None:
    mixed = Cluster.preset("mixed-cpu-gpu")
    assert mixed.route("a100", "t4") == ("a100", "cpu", "t4")
    assert mixed.bandwidth_bytes_per_s[mixed.index("a100"), mixed.index("t4")] == pytest.approx(96 * GBPS)
    hosts = Cluster.preset("two-hosts-100gbe")
    assert hosts.route("a1", "b1") == ("a1", "a0", "b0", "b1")
    assert hosts.latency_s[hosts.index("a1"), hosts.index("b1")] == pytest.approx(35e-6)
    h100 = Cluster.preset("h100x8-nvlink")
    assert len(h100) == 8 and h100.devices[0].peak_flops_for("bfloat16") == pytest.approx(989.4e12)


def test_unknown_preset() -> None:
    with pytest.raises(ClusterError, match="no preset cluster 'nope'"):
        Cluster.preset("nope")


# --- files -----------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["moirai-inter-server", "mixed-cpu-gpu", "two-hosts-100gbe"])
def test_file_round_trip(tmp_path: Path, preset: str) -> None:
    cluster = Cluster.preset(preset)
    cluster.to_file(tmp_path / "c.toml")
    again = Cluster.from_file(tmp_path / "c.toml")
    assert again.devices == cluster.devices
    assert again.name == cluster.name
    np.testing.assert_allclose(again.bandwidth_bytes_per_s, cluster.bandwidth_bytes_per_s, rtol=1e-12)
    np.testing.assert_allclose(again.latency_s, cluster.latency_s, rtol=1e-12, atol=1e-15)
    assert again.route(cluster.names[1], cluster.names[-1]) == cluster.route(cluster.names[1], cluster.names[-1])


def test_round_trip_of_a_matrix_cluster(tmp_path: Path) -> None:
    cluster = Cluster.from_devices(["cpu", "cpu"])
    cluster.to_file(tmp_path / "c.toml")
    again = Cluster.from_file(tmp_path / "c.toml")
    assert again.devices == cluster.devices
    assert again.transfer_time_s(1e6, 0, 1) == pytest.approx(cluster.transfer_time_s(1e6, 0, 1))


@given(
    st.lists(st.floats(1e-3, 1e15, allow_subnormal=False), min_size=7, max_size=7),
)
@settings(max_examples=60, deadline=None)
def test_a_cluster_file_gives_back_every_number_exactly(numbers: list[float]) -> None:
    """0.1344 TFLOPS scaled in floats is 134399999999.99998, and not every value in bytes has a float in GB that
    scales back to it: a detected CPU (its peak from its clock) came back one ulp off, now and then."""
    memory, flops, bandwidth, launch, bf16, link_bandwidth, latency = numbers
    devices = [
        Device("a", "cpu", memory, flops, bandwidth, launch * 1e-9, "cpu", peak_flops_bf16=bf16),
        Device("b", "cpu", memory, 134399999999.99998, bandwidth, 1e-5, "cpu"),
    ]
    links = [Link("a", "b", link_bandwidth, latency * 1e-12), Link("b", "a", 1.25e8 * 3.3, 0.0)]
    cluster = Cluster.from_links(devices, links, name="awkward")
    with tempfile.TemporaryDirectory() as folder:
        cluster.to_file(Path(folder) / "c.toml")
        again = Cluster.from_file(Path(folder) / "c.toml")
    assert again.devices == cluster.devices
    assert again.links == cluster.links


# Names of any characters a TOML file holds (no lone surrogates, which no UTF-8 file can), emoji and controls included.
_NAMES = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=8)


@given(
    names=st.lists(_NAMES, min_size=2, max_size=2, unique=True),
    cores=st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=4, unique=True),
    threads=st.integers(1, 4),
    cluster_name=st.text(st.characters(blacklist_categories=("Cs",)), max_size=8),
)
@settings(max_examples=60, deadline=None)
def test_to_file_writes_what_from_file_reads_back_equal(names, cores, threads, cluster_name) -> None:
    """Fault injected: a device with cores (cores = [0], a valid file) made to_file raise TypeError "no TOML form
    for list", and a name outside the BMP (an emoji) was written as a JSON surrogate pair TOML refuses to read."""
    threads = min(threads, len(cores))
    devices = [Device(name, "cpu", 8e9, 1e12, 1e10, 5e-6, "cpu", cores=tuple(cores), threads=threads) for name in names]
    links = [Link(names[0], names[1], 1e9, 1e-6), Link(names[1], names[0], 2e9, 0.0)]
    cluster = Cluster.from_links(devices, links, name=cluster_name)
    with tempfile.TemporaryDirectory() as folder:
        cluster.to_file(Path(folder) / "c.toml")
        again = Cluster.from_file(Path(folder) / "c.toml")
    assert again.devices == cluster.devices and again.links == cluster.links and again.name == cluster.name


def test_custom_file_with_type_and_explicit_numbers(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        name = "lab"

        [[devices]]
        name = "gpu"
        torch_device = "cuda:0"
        host = "box"
        rank = 1
        type = "t4"

        [[devices]]
        name = "cpu"
        kind = "cpu"
        memory_gb = 64
        peak_tflops = { fp32 = 2.0, bf16 = 4.0 }
        memory_bandwidth_gb_per_s = 100
        launch_overhead_us = 3

        [[links]]
        src = "gpu"
        dst = "cpu"
        bandwidth_gbps = 100
        latency_us = 10
        both_directions = true
        """,
    )
    cluster = Cluster.from_file(path)
    gpu, host_cpu = cluster.devices
    assert (gpu.kind, gpu.host, gpu.rank, gpu.memory_bytes) == ("cuda", "box", 1, 16e9)
    assert gpu.peak_flops == pytest.approx(8.1e12) and gpu.peak_flops_for("float16") == pytest.approx(65e12)
    assert host_cpu.peak_flops_for("bfloat16") == pytest.approx(4e12)
    assert host_cpu.peak_flops_for("float16") == pytest.approx(2e12)  # no fp16 path: the fp32 peak
    assert host_cpu.launch_overhead_s == pytest.approx(3e-6)
    assert cluster.transfer_time_s(12.5e6, 1, 0) == pytest.approx(1e-3 + 10e-6)


# --- bad input -------------------------------------------------------------------------------


_MATRIX_FILE = (
    '[[devices]]\nname = "a"\ntype = "t4"\n[[devices]]\nname = "b"\ntype = "t4"\n'
    "[matrix]\nbandwidth_gbps = [[0, 1], [1, 0]]\n"
)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (two_device_file(link='src = "a"\ndst = "b"\n'), "has no bandwidth_gbps"),
        (two_device_file(link='src = "a"\ndst = "b"\nbandwidth_gbps = -1\n'), "must be positive"),
        (two_device_file(device_b="memory_gb = 0\n"), "device 'b' has memory 0"),
        (two_device_file(link='src = "a"\ndst = "z"\nbandwidth_gbps = 1\n'), "unknown device 'z'"),
        (two_device_file().replace('name = "b"', 'name = "a"'), r"duplicate device names \['a'\]"),
        (two_device_file().replace('type = "p4"', 'type = "tpu9"'), "unknown type 'tpu9'"),
        (two_device_file(device_b="speed = 3\n"), r"unknown keys \['speed'\]"),
        (
            '[[devices]]\nname = "a"\ntype = "t4"\n[[devices]]\nname = "b"\ntype = "t4"\n'
            "[matrix]\nbandwidth_gbps = [[0, 1], [1, 0, 3]]\n",
            "must be 2x2",
        ),
        (
            '[[devices]]\nname = "a"\ntype = "t4"\n[[devices]]\nname = "b"\ntype = "t4"\n'
            "[matrix]\nbandwidth_gbps = [[0, 1], [1, 0], [1, 1]]\n",
            "must be 2x2",
        ),
        (
            '[[devices]]\nname = "a"\ntype = "t4"\n[[devices]]\nname = "b"\ntype = "t4"\n'
            "[matrix]\nbandwidth_gbps = [[0, 1], [-2, 0]]\n",
            "'b' -> 'a' is -2.0 Gbps",
        ),
        ('[[devices]]\nname = "a"\nmemory_gb = 1\n', "needs memory_bandwidth_gb_per_s"),
        ('[[devices]]\nname = "a"\ntype = "t4"\n[[devices]]\nname = "b"\ntype = "t4"\n', "needs \\[\\[links\\]\\]"),
        ("[[devices]]\nname = \"a\"\ntype = \"t4\"\n[[links]]\nsrc = 'a'\ndst = 'a'\nbandwidth_gbps = 1\n", "itself"),
        ("name = [", "not valid TOML"),
        (two_device_file() + '[[links]]\nsrc = "b"\ndst = "a"\nbandwidth_gbps = 5\n', "more than once"),
        # Fault injected: an integer no float holds was read as infinity (memory_gb: unlimited memory) or was a raw
        # OverflowError ([matrix]), and a NaN latency was called negative.
        (
            two_device_file(device_b="memory_gb = 1" + "0" * 400 + "\n"),
            "device 'b': memory_gb is an integer of about 401",
        ),
        (_MATRIX_FILE + "latency_us = 1" + "0" * 400 + "\n", r"\[matrix\] latency_us is an integer of about 401"),
        (_MATRIX_FILE + "latency_us = [[0, 1" + "0" * 400 + "], [1, 0]]\n", r"latency_us\[0\]\[1\] is an integer of"),
        (_MATRIX_FILE + "latency_us = nan\n", r"\[matrix\] latency_us is NaN"),
        (_MATRIX_FILE + "latency_us = [[0, nan], [1, 0]]\n", r"latency_us\[0\]\[1\] is NaN"),
        (_MATRIX_FILE.replace("[[0, 1], [1, 0]]", "[[0, 1e400], [1, 0]]"), "1e400 is too large for a float"),
        (two_device_file(device_b="rank = " + str(2**63) + "\n"), "rank must be an integer"),
    ],
)
def test_bad_cluster_files(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ClusterError, match=message):
        Cluster.from_file(write(tmp_path, text))


def test_missing_file() -> None:
    with pytest.raises(ClusterError, match="does not exist$"):
        Cluster.from_file("/nonexistent/cluster.toml")
    with pytest.raises(ClusterError, match=r"is a preset: Cluster.preset\('moirai-inter-server'\)"):
        Cluster.from_file("moirai-inter-server")  # a preset's name given as a file


def test_bad_matrices_given_directly() -> None:
    devices = (cpu("a"), cpu("b"))
    with pytest.raises(ClusterError, match="must be 2x2"):
        Cluster(devices, np.ones((2, 3)), np.zeros((2, 2)))
    with pytest.raises(ClusterError, match="positive bandwidth"):
        Cluster(devices, np.array([[1.0, -1.0], [1.0, 1.0]]), np.zeros((2, 2)))
    with pytest.raises(ClusterError, match="positive bandwidth"):
        Cluster(devices, np.array([[1.0, np.nan], [1.0, 1.0]]), np.zeros((2, 2)))
    with pytest.raises(ClusterError, match="non-negative"):
        Cluster(devices, np.ones((2, 2)), np.array([[0.0, -1.0], [0.0, 0.0]]))
    with pytest.raises(ClusterError, match="duplicate device names"):
        Cluster((cpu("a"), cpu("a")), np.ones((2, 2)), np.zeros((2, 2)))
    with pytest.raises(ClusterError, match="device .z. has memory 0"):
        Cluster.from_links([Device("z", "cpu", 0.0, 1e9, 1e9)], [])


# --- local devices ---------------------------------------------------------------------------


def test_detect_finds_the_local_cpu() -> None:
    cluster = Cluster.detect()
    assert cluster.devices[0].torch_device == "cpu" and cluster.devices[0].kind == "cpu"
    assert cluster.devices[0].memory_bytes > 0 and cluster.devices[0].peak_flops > 0


def test_from_devices_still_splits_one_cpu() -> None:
    cluster = Cluster.from_devices(["cpu", "cpu"])
    assert cluster.names == ("cpu_0", "cpu_1")
    assert cluster.devices[0].memory_bytes == pytest.approx(Cluster.from_devices(["cpu"]).devices[0].memory_bytes / 2)
    assert cluster.transfer_time_s(0, 0, 1) > 0


def test_device_kinds_answer_what_the_runtime_and_cost_code_ask() -> None:
    import torch

    from moirai.cluster.kinds import CPU, CUDA, backend_for, kind_for_backend, kind_of

    assert kind_of("cuda:1") is CUDA and kind_of(torch.device("cpu")) is CPU
    assert (CPU.backend, CUDA.backend) == ("gloo", "nccl")
    assert kind_for_backend("nccl") is CUDA and kind_for_backend("gloo") is CPU
    assert backend_for(["cpu", "cuda:0", "cuda:1"]) == "cpu:gloo,cuda:nccl"
    assert CUDA.messages_in_device_memory and not CPU.messages_in_device_memory
    with pytest.raises(ClusterError, match="unsupported device 'meta'"):
        kind_of("meta")


def test_core_shares_follow_the_pinning_of_split_cores() -> None:
    from moirai.cluster.host import core_shares, split_cores

    assert split_cores((0, 1), 3) == [(0,), (1,), (0,)]
    assert core_shares((0, 1), 3) == [0.5, 1.0, 0.5]  # cpu_0 and cpu_2 take turns on core 0
    assert core_shares((0, 1, 2, 3), 2) == [2.0, 2.0]


def test_more_cpu_devices_than_cores_is_named_and_priced_at_the_share_they_get(monkeypatch) -> None:
    import warnings

    import moirai.cluster.devices
    import moirai.cluster.kinds
    from moirai.errors import OversubscriptionWarning

    for module in (moirai.cluster.devices, moirai.cluster.kinds):
        monkeypatch.setattr(module, "available_cores", lambda: (0, 1))
    with pytest.warns(OversubscriptionWarning, match=r"3 logical CPU devices on 2 cores: cpu_0, cpu_2 share cores"):
        cluster = Cluster.from_devices(["cpu"] * 3)
    speeds = [d.peak_flops for d in cluster.devices]
    assert speeds[0] == pytest.approx(speeds[1] / 2) and speeds[2] == pytest.approx(speeds[1] / 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OversubscriptionWarning)
        two = Cluster.from_devices(["cpu"] * 2)
    assert two.devices[0].peak_flops == pytest.approx(two.devices[1].peak_flops) == pytest.approx(speeds[1])


def test_a_cluster_file_with_more_cpu_devices_than_cores_here_is_named_when_compiled(monkeypatch) -> None:
    import warnings

    import moirai.cluster.devices
    from moirai.cluster.calibration.cluster import local_cluster
    from moirai.errors import OversubscriptionWarning

    monkeypatch.setattr(moirai.cluster.devices, "available_cores", lambda: (0, 1))

    def cpus(count: int, **settings: object) -> Cluster:
        devices = [{"name": f"c{k}", "type": "cpu", **settings} for k in range(count)]
        bandwidth = [[0 if a == b else 10 for b in range(count)] for a in range(count)]
        return Cluster.from_dict({"devices": devices, "matrix": {"bandwidth_gbps": bandwidth}})

    with pytest.warns(OversubscriptionWarning, match=r"3 logical CPU devices on 2 cores: c0, c2 share cores") as caught:
        local_cluster(cpus(3))
    assert caught[0].filename == __file__  # the caller's line, not moirai's
    with warnings.catch_warnings():
        warnings.simplefilter("error", OversubscriptionWarning)
        local_cluster(cpus(3, host="server"))  # planned for another machine
        local_cluster(cpus(2))


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "this machine's hostname"])
def test_every_name_of_this_host_is_this_host_to_the_warning_and_the_measured_costs(monkeypatch, host) -> None:
    """One answer (hardware.is_this_host): the measured costs counted 127.0.0.1 as here, the warning did not."""
    import socket

    import moirai.cluster.devices
    from moirai.cluster.calibration.cluster import local_cluster
    from moirai.cluster.cost import _check_local
    from moirai.errors import OversubscriptionWarning

    host = socket.gethostname() if host.startswith("this") else host
    monkeypatch.setattr(moirai.cluster.devices, "available_cores", lambda: (0, 1))
    devices = [{"name": f"c{k}", "type": "cpu", "host": host} for k in range(3)]
    cluster = Cluster.from_dict(
        {"devices": devices, "matrix": {"bandwidth_gbps": [[0, 10, 10], [10, 0, 10], [10, 10, 0]]}}
    )
    assert all(d.on_this_host for d in cluster.devices)
    with pytest.warns(OversubscriptionWarning, match="3 logical CPU devices on 2 cores"):
        local_cluster(cluster)
    _check_local(cluster.devices[0])  # measurable here
    assert not Device("far", "cpu", 1e9, 1e11, 1e10, host="server").on_this_host


def test_devices_on_every_name_of_this_host_share_its_cores(monkeypatch) -> None:
    """One host key (hardware.host_key): rank_resources and from_devices grouped by the host string, so a device on
    localhost and one on 127.0.0.1 each got both cores of a 2-core machine and no warning of a third."""
    import socket
    import warnings

    import moirai.cluster.devices
    import moirai.cluster.kinds
    from moirai.errors import OversubscriptionWarning
    from moirai.runtime.resources import rank_resources

    names = ["localhost", "127.0.0.1", socket.gethostname()]
    devices = [Device(f"c{k}", "cpu", 1e9, 1e11, 1e10, host=host) for k, host in enumerate(names[:2])]
    assert [r.cores for r in rank_resources(devices, cores=[0, 1])] == [(0,), (1,)]
    far = [devices[0], Device("far", "cpu", 1e9, 1e11, 1e10, host="server")]
    assert [r.cores for r in rank_resources(far, cores=[0, 1])] == [(0, 1), (0, 1)]  # another machine's cores

    monkeypatch.setattr(moirai.cluster.devices, "available_cores", lambda: (0, 1))
    monkeypatch.setattr(moirai.cluster.kinds, "available_cores", lambda: (0, 1))
    with pytest.warns(OversubscriptionWarning, match="3 logical CPU devices on 2 cores"):
        cluster = Cluster.from_devices(["cpu"] * 3, hosts=names)
    assert [d.host for d in cluster.devices] == names  # the names are kept; only their grouping is one
    assert cluster.devices[0].peak_flops == cluster.devices[2].peak_flops < cluster.devices[1].peak_flops
    with warnings.catch_warnings():
        warnings.simplefilter("error", OversubscriptionWarning)
        Cluster.from_devices(["cpu"] * 3, hosts=["localhost", "localhost", "server"])


def test_more_threads_than_cores_is_named() -> None:
    from moirai.errors import OversubscriptionWarning
    from moirai.runtime.resources import rank_resources

    pinned = Device("busy", "cpu", 1e9, 1e11, 1e10, cores=(0,), threads=4)
    with pytest.warns(OversubscriptionWarning, match=r"'busy' runs 4 threads on 1 core\(s\) \[0\]"):
        rank_resources([pinned, "cpu"], cores=[0, 1])


def test_matrix_links_read_as_listed_links_do_and_file_numbers_copy_exactly(tmp_path: Path) -> None:
    """[matrix] scaled in floats (260.6407 Gbps was 32580087499.999996 bytes/s there, 32580087500.0 listed), and a
    number that keeps its text could not be copied or pickled."""
    import copy
    import pickle

    from moirai.cluster.hardware import GB, FloatLiteral, in_unit

    devices = "".join(
        f'[[devices]]\nname = "{n}"\npeak_tflops = {{ fp32 = 1.0 }}\nmemory_gb = 1.0\nmemory_bandwidth_gb_per_s = 1.0\n'
        for n in "ab"
    )
    matrix = (
        "[matrix]\nbandwidth_gbps = [[0.0, 260.6407], [260.6407, 0.0]]\nlatency_us = [[0.0, 31.551], [31.551, 0.0]]\n"
    )
    listed = "".join(
        f'[[links]]\nsrc = "{s}"\ndst = "{d}"\nbandwidth_gbps = 260.6407\nlatency_us = 31.551\n'
        for s, d in ("ab", "ba")
    )
    (tmp_path / "m.toml").write_text(devices + matrix)
    (tmp_path / "l.toml").write_text(devices + listed)
    assert Cluster.from_file(tmp_path / "m.toml").links == Cluster.from_file(tmp_path / "l.toml").links
    literal = in_unit(4368887181967.4917, GB)
    assert isinstance(literal, FloatLiteral)
    assert copy.deepcopy(literal).text == pickle.loads(pickle.dumps(literal)).text == literal.text

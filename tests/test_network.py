"""Choosing gloo's network interface under torchrun across hosts."""

from __future__ import annotations

import pytest

from moirai.errors import DistributedError
from moirai.runtime.network import choose_gloo_interface, interface_holding, source_address_towards

INTERFACES = {"lo": ["127.0.0.1", "::1"], "eth0": ["10.77.0.2", "fe80::1%eth0", "02:42:ac:11:00:02"], "wg0": []}


def choose(environment: dict[str, str], source: str = "10.77.0.2") -> str | None:
    return choose_gloo_interface(environment, rank=1, source_address=lambda _: source, interfaces=lambda: INTERFACES)


def test_the_interface_that_routes_to_the_master_is_set_and_named(capsys) -> None:
    environment = {"MASTER_ADDR": "10.77.0.1"}
    assert choose(environment) == "eth0"
    assert environment["GLOO_SOCKET_IFNAME"] == "eth0"
    (line,) = capsys.readouterr().err.splitlines()
    assert "rank 1" in line and "eth0" in line and "10.77.0.1" in line


def test_a_set_variable_or_a_loopback_master_is_left_alone(capsys) -> None:
    given = {"MASTER_ADDR": "10.77.0.1", "GLOO_SOCKET_IFNAME": "wg0"}
    assert choose(given) is None and given["GLOO_SOCKET_IFNAME"] == "wg0"
    for master in ("127.0.0.1", "localhost", "::1"):
        environment = {"MASTER_ADDR": master}
        assert choose(environment, source="127.0.0.1") is None and "GLOO_SOCKET_IFNAME" not in environment
    assert choose({}) is None
    assert capsys.readouterr().err == ""


def test_no_interface_with_the_source_address_fails_at_once_naming_the_variable() -> None:
    with pytest.raises(DistributedError, match="GLOO_SOCKET_IFNAME"):
        choose({"MASTER_ADDR": "10.77.0.1"}, source="192.168.5.5")


def test_an_unresolvable_master_fails_naming_the_variable() -> None:
    with pytest.raises(DistributedError, match="MASTER_ADDR 'no-such-host.invalid'.*GLOO_SOCKET_IFNAME"):
        choose({"MASTER_ADDR": "no-such-host.invalid"})


def test_an_address_is_matched_to_its_interface() -> None:
    assert interface_holding("10.77.0.2", INTERFACES) == "eth0"
    assert interface_holding("fe80::1", INTERFACES) == "eth0"
    assert interface_holding("::1", INTERFACES) == "lo"
    assert interface_holding("10.77.0.3", INTERFACES) is None


def test_the_kernel_names_the_source_address_of_a_route() -> None:
    assert source_address_towards("127.0.0.1") == "127.0.0.1"

"""Which network interface gloo uses under torchrun across hosts.

gloo binds to the address its host's name resolves to, which on many machines (and in every container whose
``/etc/hosts`` maps its name to 127.0.x.1) is loopback: the other hosts' connections are then refused, and
``init_process_group`` fails only after its whole timeout with a raw gloo error. So when ``GLOO_SOCKET_IFNAME``
is unset and the master address is not loopback, :func:`choose_gloo_interface` sets it to the interface this
host reaches the master through (the source address the kernel picks for it, matched against the interfaces'
addresses), or raises a :class:`moirai.DistributedError` naming the variable at once.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from collections.abc import Callable, Mapping, MutableMapping, Sequence

from moirai.errors import DistributedError

GLOO_INTERFACE_ENV = "GLOO_SOCKET_IFNAME"
_MASTER_ADDR_ENV = "MASTER_ADDR"
# Any port: a UDP connect sends nothing, it only asks the kernel for a route and a source address.
_PROBE_PORT = 9


def choose_gloo_interface(
    environment: MutableMapping[str, str] | None = None,
    rank: int = 0,
    source_address: Callable[[str], str] | None = None,
    interfaces: Callable[[], Mapping[str, Sequence[str]]] | None = None,
) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` in ``environment`` (default: this process's) to the interface that routes to
    ``MASTER_ADDR``, say which on stderr, and return it; None where nothing is to choose (the variable is set,
    or the master is this host's loopback)."""
    environment = os.environ if environment is None else environment
    if environment.get(GLOO_INTERFACE_ENV) or not environment.get(_MASTER_ADDR_ENV):
        return None
    master = environment[_MASTER_ADDR_ENV]
    master_ip = _resolve(master)
    if master_ip.is_loopback:
        return None
    local_ip = (source_address or source_address_towards)(str(master_ip))
    name = interface_holding(local_ip, (interfaces or interface_addresses)())
    if name is None:
        raise DistributedError(
            f"no network interface of this host holds {local_ip}, the address it reaches {_MASTER_ADDR_ENV} "
            f"{master} from; set {GLOO_INTERFACE_ENV} to the interface gloo should use (see `ip addr`)"
        )
    environment[GLOO_INTERFACE_ENV] = name
    print(
        f"moirai rank {rank}: gloo uses interface {name} ({local_ip}), the one that routes to {_MASTER_ADDR_ENV} "
        f"{master}; set {GLOO_INTERFACE_ENV} to choose another",
        file=sys.stderr,
        flush=True,
    )
    return name


def interface_holding(address: str, interfaces: Mapping[str, Sequence[str]]) -> str | None:
    """The name of the interface among ``interfaces`` (name -> its addresses) that holds ``address``, if any."""
    wanted = ipaddress.ip_address(address)
    for name, addresses in interfaces.items():
        for held in addresses:
            try:
                if ipaddress.ip_address(held.split("%")[0]) == wanted:  # an IPv6 link-local address ends in %zone
                    return name
            except ValueError:
                continue  # a hardware (MAC) address
    return None


def source_address_towards(address: str) -> str:
    """The local address the kernel would send from to reach ``address`` (a UDP connect: nothing is sent)."""
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((address, _PROBE_PORT))
            return probe.getsockname()[0]
    except OSError as error:
        raise DistributedError(
            f"this host has no route to {_MASTER_ADDR_ENV} {address} ({error.strerror}); check the address, or set "
            f"{GLOO_INTERFACE_ENV} to the interface gloo should use"
        ) from None


def interface_addresses() -> dict[str, list[str]]:
    """Every interface of this host with its IP addresses."""
    import psutil

    return {
        name: [entry.address for entry in entries if entry.family in (socket.AF_INET, socket.AF_INET6)]
        for name, entries in psutil.net_if_addrs().items()
    }


def _resolve(master: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        return ipaddress.ip_address(master)
    except ValueError:
        pass
    try:
        return ipaddress.ip_address(socket.getaddrinfo(master, None)[0][4][0])
    except (OSError, IndexError) as error:
        raise DistributedError(
            f"{_MASTER_ADDR_ENV} {master!r} does not resolve ({error}); give an address, or set {GLOO_INTERFACE_ENV} "
            "to the interface gloo should use"
        ) from None

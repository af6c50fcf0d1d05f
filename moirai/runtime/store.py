"""The key-value store of a run moirai starts: on loopback only, every value sealed with the run's secret.

torch's TCPStore has no authentication, and any client may list and read its keys. A run that
moirai starts (:class:`moirai.runtime.distributed.DistributedRunner`, the calibration) therefore
listens on 127.0.0.1 only (:func:`start_store`: moirai binds the socket and hands TCPStore its
descriptor), and every value moirai writes is encrypted and authenticated with a random per-run
secret that rank 0 hands the ranks it spawns through their process arguments, never through the
store (:class:`RunStore`): a client without the secret reads noise, and a value it writes fails
the check with a :class:`moirai.DistributedError` naming the key. Keys live under a namespace
derived from the secret, so two runs never read each other's keys. Under torchrun the store is
torchrun's: a :class:`RunStore` without a secret passes values through as they are.

A JSON value read from the store (a peer's report, address, timings, plan) is read through :func:`get_json`,
which checks its shape and names the key where it is none: under torchrun the store is the network's.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from moirai.errors import DistributedError

SECRET_BYTES = 32
RUN_SECRET_ENV = "MOIRAI_RUN_SECRET"  # under torchrun: the run's secret, hex, the same on every rank
_NONCE_BYTES = 16
_TAG_BYTES = 32
_BLOCK_BYTES = hashlib.sha256().digest_size
_LISTEN_BACKLOG = 128


def new_secret() -> bytes:
    """A run's secret: rank 0 makes it and passes it to the ranks it spawns in their arguments."""
    return secrets.token_bytes(SECRET_BYTES)


def derived_key(secret: bytes, purpose: str) -> bytes:
    """A key for one use of the run's secret (store values, headers), so that no two uses share a key."""
    return hmac.new(secret, f"moirai {purpose}".encode(), hashlib.sha256).digest()


class RunStore:
    """A store's keys under this run's namespace, values sealed (encrypted, then authenticated with the key's name).

    ``raw`` is the underlying store (gloo and NCCL rendezvous through :meth:`prefix_store`); ``secret`` None
    (torchrun's own store) leaves keys and values as they are.
    """

    def __init__(self, raw: Any, secret: bytes | None) -> None:
        self.raw = raw
        self.secret = secret
        self.prefix = "" if secret is None else derived_key(secret, "namespace")[:12].hex() + "/"
        self._cipher_key = None if secret is None else derived_key(secret, "store cipher")
        self._mac_key = None if secret is None else derived_key(secret, "store mac")

    @property
    def port(self) -> int:
        return self.raw.port

    def prefix_store(self, name: str) -> Any:
        """A torch store for a process group's rendezvous under this run's namespace."""
        return dist.PrefixStore(f"{self.prefix}{name}", self.raw)

    def set(self, key: str, value: str | bytes) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self.raw.set(self.prefix + key, self._seal(key, data))

    def get(self, key: str) -> bytes:
        return self._open(key, self.raw.get(self.prefix + key))

    def check(self, keys: Sequence[str]) -> bool:
        return self.raw.check([self.prefix + key for key in keys])

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        names = [self.prefix + key for key in keys]
        if timeout is None:
            self.raw.wait(names)
        else:
            self.raw.wait(names, timeout)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.raw.set_timeout(timeout)

    def _seal(self, key: str, data: bytes) -> bytes:
        if self._cipher_key is None:
            return data
        nonce = secrets.token_bytes(_NONCE_BYTES)
        sealed = _xor(data, self._keystream(nonce, len(data)))
        return nonce + self._tag(key, nonce, sealed) + sealed

    def _open(self, key: str, value: bytes) -> bytes:
        if self._cipher_key is None:
            return value
        nonce, tag, sealed = value[:_NONCE_BYTES], value[_NONCE_BYTES : _NONCE_BYTES + _TAG_BYTES], value[48:]
        if len(value) < _NONCE_BYTES + _TAG_BYTES or not hmac.compare_digest(tag, self._tag(key, nonce, sealed)):
            raise DistributedError(
                f"store key {key!r} failed its authentication check: a process without this run's secret wrote it "
                "(another local user or program on this run's port); the run stops instead of trusting it"
            )
        return _xor(sealed, self._keystream(nonce, len(sealed)))

    def _tag(self, key: str, nonce: bytes, sealed: bytes) -> bytes:
        assert self._mac_key is not None
        return hmac.new(self._mac_key, key.encode() + b"\0" + nonce + sealed, hashlib.sha256).digest()

    def _keystream(self, nonce: bytes, size: int) -> bytes:
        assert self._cipher_key is not None
        blocks = -(-size // _BLOCK_BYTES)
        return b"".join(
            hmac.new(self._cipher_key, nonce + counter.to_bytes(8, "little"), hashlib.sha256).digest()
            for counter in range(blocks)
        )


def _xor(data: bytes, stream: bytes) -> bytes:
    return (int.from_bytes(data, "little") ^ int.from_bytes(stream[: len(data)], "little")).to_bytes(
        len(data), "little"
    )


def loopback_listener(port: int = 0) -> socket.socket:
    """A socket listening on 127.0.0.1:``port`` (0: a free one) for a store to take over (:func:`start_store`)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", port))
        listener.listen(_LISTEN_BACKLOG)
    except BaseException:
        listener.close()
        raise
    return listener


def start_store(
    world_size: int, timeout_s: float, secret: bytes | None = None, port: int = 0, listen_fd: int | None = None
) -> RunStore:
    """Rank 0: a new store listening on 127.0.0.1:``port`` (0: any free port) only, sealed with ``secret``
    (default: a new one). ``listen_fd``: a socket already listening there, which the store takes over (a parent
    that holds the port from the start, so no other process can take it between choosing it and listening on it).

    The other ranks join with :func:`join_store` and the same secret, handed to them in their process arguments
    or environment (not on a command line, which every local user can read).
    """
    if listen_fd is None:
        with loopback_listener(port) as listener:
            port = listener.getsockname()[1]
            # TCPStore closes the descriptor it listens on when it goes, so it must be its only owner: a second
            # close (the socket object's) would close whatever another thread had opened under that number.
            listen_fd = listener.detach()
    else:
        with socket.socket(fileno=listen_fd) as listener:
            address = listener.getsockname()
            listener.detach()
        if address != ("127.0.0.1", port):
            os.close(listen_fd)
            raise DistributedError(f"the store's inherited socket listens on {address}, not 127.0.0.1:{port}")
    try:
        raw = dist.TCPStore(
            "127.0.0.1",
            port,
            world_size,
            is_master=True,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=listen_fd,
        )
    except BaseException:
        os.close(listen_fd)  # a TCPStore that fails to start leaves the descriptor open
        raise
    return RunStore(raw, new_secret() if secret is None else secret)


def join_store(port: int, world_size: int, secret: bytes, timeout_s: float) -> RunStore:
    """A rank other than 0: the run's store on 127.0.0.1:``port``, sealed with the secret rank 0 handed over."""
    raw = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    return RunStore(raw, secret)


class StoreSilent(DistributedError):
    """A store call that did not return within its bound: the store's host, or the network to it, went away."""


def answered_within(call: Callable[[], Any], timeout_s: float) -> Any:
    """``call()``'s result (or its exception), or :class:`StoreSilent` after ``timeout_s``. The call runs on a daemon
    thread, left behind where it does not return (a process's exit does not wait for it); a store whose call is left
    behind holds its connection's lock, so its later calls time out here too."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as error:  # raised again on the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=run, name="moirai-store-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise StoreSilent(f"the store did not answer within {timeout_s:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


# How long a store may take to answer one call while another rank works: a live store answers in milliseconds.
STORE_ANSWER_S = 10.0
_KEY_POLL_S = 0.2


def wait_for_key(
    store: Any, key: str, who: str, doing: str, timeout_s: float, answer_s: float = STORE_ANSWER_S
) -> None:
    """Wait up to ``timeout_s`` for ``who`` (e.g. ``rank 0 (host a)``) to set ``key`` while it is ``doing`` something;
    a :class:`moirai.DistributedError` saying what happened to it otherwise: the store closed (under torchrun it
    lives in the launcher of node 0, which exits when its rank fails), stopped answering (its host or the network to
    it went away), or the time ran out."""
    deadline = time.monotonic() + timeout_s
    while not store_call(lambda: store.check([key]), who, doing, answer_s):
        if time.monotonic() > deadline:
            raise DistributedError(f"{who} was still {doing} after {timeout_s:g} s; see its output for why")
        time.sleep(_KEY_POLL_S)


def store_call(call: Callable[[], Any], who: str, doing: str, answer_s: float = STORE_ANSWER_S) -> Any:
    """``call()`` on the store, bounded by ``answer_s``, while ``who`` is ``doing`` something: a
    :class:`moirai.DistributedError` saying what happened where the store closed (under torchrun it lives in the
    launcher of node 0, which exits when its rank fails) or stopped answering (its host or the network to it went
    away)."""
    try:
        return answered_within(call, answer_s)
    except StoreSilent:
        raise DistributedError(
            f"the store stopped answering (for {answer_s:g} s) while {who} was {doing}: its host, or the network "
            f"to it, went away; check that host and start the run again"
        ) from None
    except (RuntimeError, dist.DistStoreError) as error:
        raise DistributedError(
            f"the store closed while {who} was {doing} ({str(error).splitlines()[0][:160]}): under torchrun it "
            f"closes when the launcher of node 0 exits, so {who} failed or was stopped; see its output for why"
        ) from None


# How much of a value that is none of what its key should hold an error shows.
SHOWN_CHARS = 120


def get_json(
    store: Any,
    key: str,
    what: str,
    valid: Callable[[Any], bool],
    expected: str = "",
    answer_s: float | None = None,
) -> Any:
    """The JSON value under ``key`` (UTF-8), where ``valid(value)`` says it is ``what`` the key should hold (``"host"``,
    ``"failure report"``); else a :class:`moirai.DistributedError` naming the key and showing what it holds
    (:func:`json_value`). ``expected`` describes the shape for that message; ``answer_s``: bound the read as
    :func:`answered_within` does (a store across a network that went away)."""
    raw = store.get(key) if answer_s is None else answered_within(lambda: store.get(key), answer_s)
    return json_value(key, raw, what, valid, expected)


def json_value(key: str, raw: bytes, what: str, valid: Callable[[Any], bool], expected: str = "") -> Any:
    """:func:`get_json` on the bytes ``raw`` already read from ``key``. ``valid`` sees only a decoded value, and
    must return False, not raise, for one of the wrong shape."""
    raw = bytes(raw)
    try:
        value = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):  # not UTF-8 (UnicodeDecodeError), not JSON, or nested past the parser
        pass
    else:
        if valid(value):
            return value
    shown = repr(raw)
    if len(shown) > SHOWN_CHARS:
        shown = f"{shown[:SHOWN_CHARS]}, cut to {SHOWN_CHARS} characters"
    raise DistributedError(
        f"store key {key!r} holds no {what} (got {shown}){f'; expected {expected}' if expected else ''}: a process "
        "that is no rank of this run wrote it, or a rank runs another version of moirai; run the same moirai on "
        "every rank, and start them again"
    )

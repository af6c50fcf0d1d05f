"""The messages between ranks: request headers, tags, the transfers of one request, and a serving rank's loop.

Rank 0 sends every other rank a small header per request (a gloo message: which program, the
request's symbolic dimension values, its time limit), or a header that loads a program, is an
idle driver's heartbeat or closes the rank (:class:`Header`, its :class:`HeaderKind`). Every message of request ``r``
carries a tag made of ``r`` and its position in the request (header, inputs, the program's
transfers in their global order, outputs, each working rank's status: did its part raise,
:mod:`moirai.runtime.isolation`), so gloo matches messages per request; NCCL ignores
tags and matches by order, which every rank keeps (requests in order, each part's messages in
the program's global order, see :mod:`moirai.runtime.split`). Receive buffers take their shapes from the
traced specs with the header's symbolic dimension values (:func:`moirai.runtime.split.concrete_shape`).

A failed send, receive or wait raises :class:`moirai.runtime.blame.PeerFailure` naming the peer.

Every header carries an HMAC (SHA-256) of the receiver's rank, the header's position in its
sequence, its fields and a digest of its payload, keyed with the run's secret
(:mod:`moirai.runtime.store`): a rank checks it before it reads the payload, and a header that
fails the check is a :class:`moirai.DistributedError`, never acted on. A load's payload is the
program with only the receiving rank's part (:func:`program_for_rank`), as data that names nothing a rank would run
beyond torch's operators (:mod:`moirai.runtime.program_codec`: never a pickle); a rank without
the run's secret (torchrun, ``MOIRAI_RUN_SECRET`` unset) refuses loads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import hmac
import itertools
import json
import math
import queue
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, NamedTuple

import torch
import torch.fx as fx

from moirai.cluster.kinds import host_device, kind_of
from moirai.errors import DistributedError, PlanError
from moirai.frontend.trace import ALIGNMENT_BYTES, TensorSpec
from moirai.runtime import isolation
from moirai.runtime.blame import PeerFailure
from moirai.runtime.groups import Group, Work, placed_part
from moirai.runtime.header import DIGEST_WORDS, HEADER_DTYPE, HEADER_FIELDS, HEADER_WORDS
from moirai.runtime.program_codec import decode_program, encode_program
from moirai.runtime.split import (
    OutputLocation,
    SplitProgram,
    TensorTransfer,
    concrete_shape,
    symbol_values,
    with_layout,
)
from moirai.runtime.store import derived_key

_HEADER_DTYPE = getattr(torch, HEADER_DTYPE)
_MAX_PAYLOAD_BYTES = 1 << 40
# Tag = request index modulo a window, then the message's position in the request (0 header, 1 payload).
_TAG_BITS = 20
_TAG_WINDOW = 2048
_FIRST_DATA_TAG = 2
# Headers queued ahead of the request a rank runs, each with its receives posted (one more waits for a place): gloo's
# "ready to receive" queues behind the link's backlog ([Note: receives posted ahead]); the driver's in-flight limit
# bounds how many exist.
HEADERS_READ_AHEAD = 4
_SOURCE_LOCATION = re.compile(r"\[[^\]\s]+\.(?:cc|cpp|h):\d+\]\s*")


class HeaderKind(IntEnum):
    """What a header tells a rank, sent as its ``kind`` field (the layout is :mod:`moirai.runtime.header`'s)."""

    RUN = 1
    LOAD = 2
    HEARTBEAT = 3
    CLOSE = 4

    def __str__(self) -> str:
        return self.name

    @classmethod
    def from_wire(cls, value: int, rank: int, sequence: int) -> HeaderKind:
        """The kind a received header names, or a :class:`moirai.DistributedError` naming the unknown number."""
        try:
            return cls(value)
        except ValueError:
            known = ", ".join(f"{kind.value} ({kind.name})" for kind in cls)
            raise DistributedError(
                f"rank {rank}: header {sequence} has kind {value}, which is none of {known}: rank 0 runs another "
                "version of moirai's protocol; run the same moirai on every rank"
            ) from None


@dataclass
class PendingReceive:
    """A posted receive: what :meth:`Messages.wait_recv` waits for."""

    work: Work
    buffer: torch.Tensor
    what: str
    src: int
    stride: tuple[int, ...] | None = None  # the strides the received tensor gets back (TensorSpec.stride)
    offset_bytes: int = 0  # and how far past an alignment boundary it starts (TensorSpec.offset_bytes)
    requires_grad: bool = False  # and whether it requires grad (TensorSpec.requires_grad)

    def __repr__(self) -> str:
        return f"PendingReceive({self.what})"


class _PostedSend(NamedTuple):
    """A posted send, kept (with its staged tensor) until :meth:`Messages.wait_sends` waits for it."""

    work: Work
    staged: torch.Tensor
    what: str
    dst: int

    def __repr__(self) -> str:
        return f"_PostedSend({self.what})"


class Messages:
    """One rank's messages of one request: tags from the request index, its time limit, readable failures."""

    def __init__(
        self,
        group: Group,
        sequence: int,
        timeout: datetime.timedelta,
        values: dict[str, int] | None = None,
        control: bool = False,
        input_layouts: Mapping[int, InputLayout] | None = None,
    ) -> None:
        self.group = group
        self.control = control  # request headers: over gloo, a connection of their own
        self.request = sequence
        self.timeout = timeout
        self.input_layouts = input_layouts or {}  # by flat input index: the caller's layout where not a new tensor's
        self.values = values or {}
        self._tag_base = (sequence % _TAG_WINDOW) << _TAG_BITS
        self._sends: list[_PostedSend] = []

    def _wire(self, peer: int) -> torch.device:
        """Where a message to or from ``peer`` lives: a control message (a header, its payload) in host memory, also
        between two CUDA ranks (over gloo's control connection or shared memory, matched by tag, which NCCL's
        messages, matched by order, are not); data where :meth:`Group.wire_device` says."""
        return host_device() if self.control else self.group.wire_device(peer)

    def send(self, tensor: torch.Tensor, dst: int, index: int, what: str) -> None:
        wire = self._wire(dst)
        staged = tensor.detach().to(wire).resolve_conj().resolve_neg().contiguous()  # bytes that hold the values
        what = f"sending {what} to rank {dst}"
        with self._naming_peer(what, dst):
            work = self.group.link(wire, dst, self.control).send([staged], dst, self._tag_base | index)
        # A shared-memory send is done once posted: recording it would only cost wait_sends a call per message,
        # on the driver's and the ranks' cores, every request.
        if not getattr(work, "complete_when_posted", False):
            self._sends.append(_PostedSend(work, staged, what, dst))

    def post_recv(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        src: int,
        index: int,
        what: str,
        stride: tuple[int, ...] | None = None,
        offset_bytes: int = 0,
        requires_grad: bool = False,
    ) -> PendingReceive:
        wire = self._wire(src)
        buffer = torch.empty(shape, dtype=dtype, device=wire)
        what = f"receiving {what} from rank {src}"
        with self._naming_peer(what, src):
            work = self.group.link(wire, src, self.control).recv([buffer], src, self._tag_base | index)
        return PendingReceive(work, buffer, what, src, stride, offset_bytes, requires_grad)

    def post_recv_spec(self, spec: TensorSpec, src: int, index: int, what: str) -> PendingReceive:
        """A receive of a tensor of ``spec`` that gets the traced layout back when waited for
        ([Note: a received tensor keeps its traced strides])."""
        shape = concrete_shape(spec, self.values)
        return self.post_recv(shape, spec.dtype, src, index, what, spec.stride, spec.offset_bytes, spec.requires_grad)

    def wait_recv(self, pending: PendingReceive) -> torch.Tensor:
        """The received tensor: on this rank's device with its traced strides, or on the host for a control message
        (:meth:`_wire`)."""
        self._wait(pending.work, pending.what, pending.buffer.device, pending.src)
        if self.control:
            return pending.buffer
        received = pending.buffer.to(self.group.devices[self.group.rank])
        return with_layout(received, pending.stride, pending.offset_bytes, pending.requires_grad)

    def wait_sends(self) -> None:
        for work, staged, what, dst in self._sends:
            self._wait(work, what, staged.device, dst)
        self._sends.clear()

    def _wait(self, work: Work, what: str, wire: torch.device, peer: int) -> None:
        with self._naming_peer(what, peer):
            # NCCL waits are asynchronous (the compute stream waits); the process group's timeout bounds them.
            if kind_of(wire).messages_in_device_memory:
                work.wait()
            else:
                work.wait(self.timeout)

    @contextlib.contextmanager
    def _naming_peer(self, what: str, peer: int) -> Iterator[None]:
        """A failed post or wait (a closed connection, a timeout) as a failure that names the peer."""
        try:
            yield
        except DistributedError:
            raise  # this rank's own (a full /dev/shm): not the peer's failure
        except Exception as error:
            # The transport's message is kept, not its traceback: a wait on a peer has nothing of ours to show.
            raise PeerFailure(f"rank {self.group.rank}: {what} failed ({transport_error(error)})", peer) from None


def transport_error(error: BaseException) -> str:
    """A process group's error in a line: gloo's and c10d's source locations (``[.../unbound_buffer.cc:78] ``) cut."""
    text = _SOURCE_LOCATION.sub("", str(error)).strip()
    return f"{type(error).__name__}: {text[:200]}"


class _Transport:
    """What a part's send/post_recv/wait_recv nodes call (see :class:`moirai.runtime.split.Transport`)."""

    def __init__(
        self, program: SplitProgram, messages: Messages, preposted: dict[int, PendingReceive] | None = None
    ) -> None:
        self._transfers = program.transfers
        self._first_tag = _FIRST_DATA_TAG + len(program.input_specs)
        self._messages = messages
        self._preposted = dict(preposted or {})  # by transfer index: receives posted before the part ran
        # What the part did, so that a part that raises can still send and receive the rest of its messages.
        self.sent: set[int] = set()
        self.posted: dict[int, PendingReceive] = {}  # by position in the program's transfers
        self.waited: set[int] = set()  # ids of the receives waited for

    def send(self, tensor: torch.Tensor, transfer_index: int) -> None:
        transfer = self._transfers[transfer_index]
        self._messages.send(tensor, transfer.dst, self._first_tag + transfer.index, f"tensor {transfer.tensor}")
        self.sent.add(transfer_index)

    def post_recv(self, transfer_index: int) -> PendingReceive:
        pending = self._preposted.pop(transfer_index, None)
        if pending is None:
            pending = _post_transfer_recv(self._messages, self._transfers[transfer_index], self._first_tag)
        self.posted[transfer_index] = pending
        return pending

    def wait_recv(self, pending: PendingReceive) -> torch.Tensor:
        received = self._messages.wait_recv(pending)
        self.waited.add(id(pending))
        return received

    @property
    def symbol_values(self) -> dict[str, int]:
        """This request's symbolic dimension sizes: parts compute shape scalars from them."""
        return self._messages.values


def check_tags(program: SplitProgram) -> None:
    messages = _FIRST_DATA_TAG + len(program.input_specs) + len(program.transfers) + len(program.outputs)
    messages += program.num_devices  # each rank's status
    if messages >= 1 << _TAG_BITS:
        raise PlanError(f"the program sends {messages} messages per request; at most {(1 << _TAG_BITS) - 1} fit a tag")


def request_message_bytes(program: SplitProgram, flat_inputs: Sequence[torch.Tensor]) -> list[int]:
    """The bytes of every tensor message of one request at these flat inputs: the flat inputs rank 0 sends the
    other parts (:func:`send_inputs`), the tensors between parts and the flat outputs the other parts send back."""
    values = symbol_values(program, flat_inputs)

    def message_bytes(spec: TensorSpec) -> int:
        return math.prod(concrete_shape(spec, values)) * spec.dtype.itemsize

    inputs = [
        flat_inputs[i].numel() * flat_inputs[i].element_size() for p in program.parts[1:] for i in p.input_indices
    ]
    transfers = [message_bytes(transfer.spec) for transfer in program.transfers]
    outputs = [message_bytes(program.parts[at.device].output_specs[at.index]) for at in _sent_outputs(program)]
    return inputs + transfers + outputs


def _sent_outputs(program: SplitProgram) -> dict[OutputLocation, int]:
    """The flat outputs other parts send rank 0, each once however often the model returns it (one tensor, which
    the caller gets as often), with the position of its first return: its message's tag."""
    first: dict[OutputLocation, int] = {}
    for position, location in enumerate(program.outputs):
        if location.device != 0:
            first.setdefault(location, position)
    return first


def send_inputs(program: SplitProgram, messages: Messages, flat_inputs: Sequence[torch.Tensor]) -> None:
    """Rank 0: send every other part the flat inputs it reads (before part 0 runs, so that a driver can
    start the next requests on the other ranks while part 0 still waits for this one)."""
    for other in program.parts[1:]:
        for index in other.input_indices:
            messages.send(flat_inputs[index], other.device, _FIRST_DATA_TAG + index, f"flat input {index}")


def _post_outputs(
    program: SplitProgram,
    messages: Messages,
    pending: dict[int, PendingReceive],
    statuses: dict[int, PendingReceive],
    by_order: bool,
) -> None:
    """Rank 0: post the receives of the other parts' flat outputs and statuses on the links that match messages
    by order (``by_order``, NCCL's) or by tag (gloo, shared memory), into ``pending`` and ``statuses``."""
    first_tag = _FIRST_DATA_TAG + len(program.input_specs) + len(program.transfers)
    status_tag = first_tag + len(program.outputs)
    group = messages.group
    for location, position in _sent_outputs(program).items():
        if matches_by_order(group, location.device) == by_order:
            spec = program.parts[location.device].output_specs[location.index]
            pending[position] = messages.post_recv_spec(
                spec, location.device, first_tag + position, f"flat output {position}"
            )
    for k in program.working_ranks:
        if matches_by_order(group, k) == by_order:
            statuses[k] = messages.post_recv((1,), torch.int64, k, status_tag + k, "its status")


class Preposted(NamedTuple):
    """A request's receives, posted before its part runs (see [Note: receives posted ahead])."""

    messages: Messages
    inputs: dict[int, PendingReceive]  # by flat input index
    transfers: dict[int, PendingReceive]  # by transfer index


def _post_input_recv(messages: Messages, program: SplitProgram, index: int) -> PendingReceive:
    """A flat input gets the layout the caller's tensor had, which the request's header says where it is not a new
    tensor's ([Note: a received tensor keeps its traced strides])."""
    spec = program.input_specs[index]
    shape = concrete_shape(spec, messages.values)
    layout = messages.input_layouts.get(index, InputLayout())
    what = f"flat input {index}"
    return messages.post_recv(shape, spec.dtype, 0, _FIRST_DATA_TAG + index, what, *layout)


def _post_transfer_recv(messages: Messages, transfer: TensorTransfer, first_tag: int) -> PendingReceive:
    return messages.post_recv_spec(transfer.spec, transfer.src, first_tag + transfer.index, f"tensor {transfer.tensor}")


def run_part(
    program: SplitProgram,
    group: Group,
    module: fx.GraphModule,
    messages: Messages,
    flat_inputs: Sequence[torch.Tensor] | None,
    preposted: Preposted | None = None,
) -> Callable[[], list[torch.Tensor] | None]:
    """Run this rank's part of one request; returns what finishes it (rank 0: the flat outputs, others: None).

    Rank 0 runs part 0 (after :func:`send_inputs`) and posts the receives of the other parts'
    outputs; the others receive their inputs, run their part and send their outputs. ``preposted``: this
    request's receives, posted before (``messages`` is then ``preposted.messages``).
    """
    rank, device = group.rank, group.devices[group.rank]
    part = program.parts[rank]
    if flat_inputs is not None:
        local_inputs = [flat_inputs[index] for index in part.input_indices]
    else:
        early = preposted.inputs if preposted is not None else {}
        pending_inputs = [early.get(i) or _post_input_recv(messages, program, i) for i in part.input_indices]
        local_inputs = [messages.wait_recv(p) for p in pending_inputs]
    pending: dict[int, PendingReceive] = {}
    statuses: dict[int, PendingReceive] = {}
    if rank == 0:
        # Where messages match by tag, posted before part 0 sends anything, so that gloo's "ready to receive" for
        # them goes out first ([Note: receives posted ahead]); NCCL matches by order: after part 0, as its peers.
        _post_outputs(program, messages, pending, statuses, by_order=False)
    transport = _Transport(program, messages, preposted.transfers if preposted is not None else None)
    failure = None
    try:
        with torch.no_grad():
            # forward, not __call__: fx's wrapper drops the traceback that names the op that raised.
            part_outputs = module.forward(transport, *(t.to(device) for t in local_inputs))
    except DistributedError:
        raise  # a failed message: a rank died or hung
    except Exception as error:
        failure = isolation.part_failure(rank, module, error)
        isolation.settle_failed_part(transport, program.transfers, rank, messages.values)
        part_outputs = [spec and isolation.placeholder(spec, messages.values) for spec in part.output_specs]
    first_tag = _FIRST_DATA_TAG + len(program.input_specs) + len(program.transfers)
    status_tag = first_tag + len(program.outputs)
    if rank != 0:
        for location, position in _sent_outputs(program).items():
            if location.device == rank:
                messages.send(part_outputs[location.index], 0, first_tag + position, f"flat output {position}")
        if failure is not None:
            isolation.report_part_failure(group.store, messages.request, failure)  # before the status that points to it
        status = torch.tensor([isolation.STATUS_OK if failure is None else isolation.STATUS_FAILED], dtype=torch.int64)
        if not part.idle:  # rank 0 waits for the working ranks' statuses (an idle rank runs only under run_rank)
            messages.send(status, 0, status_tag + rank, "its status")

        def finish_sends() -> None:
            messages.wait_sends()

        return finish_sends
    _post_outputs(program, messages, pending, statuses, by_order=True)

    def finish_outputs() -> list[torch.Tensor]:
        sent = _sent_outputs(program)
        received = {position: messages.wait_recv(pending[position]) for position in sorted(pending)}
        outputs = [
            received[sent[location]] if location.device != 0 else part_outputs[location.index]
            for location in program.outputs
        ]
        failed = [k for k in sorted(statuses) if int(messages.wait_recv(statuses[k])[0]) != isolation.STATUS_OK]
        messages.wait_sends()
        failures = [failure] if failure is not None else []
        failures += [isolation.read_part_failure(group.store, messages.request, k) for k in failed]
        if failures:
            raise isolation.request_error(program, group.devices, messages.request, failures)
        return outputs

    return finish_outputs


def serve(group: Group, programs: dict[int, SplitProgram], timeout_s: float) -> None:
    """A non-driver rank: run each request rank 0 announces, in order, until rank 0 closes (a heartbeat only
    shows that rank 0 lives).

    The sends of request ``r`` are waited for after running request ``r + 1``, so this rank can
    run ahead of its receivers by one request. Over gloo the headers are read ahead ([Note: receives posted
    ahead]).
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    reads_ahead = group.link(group.wire_device(0), 0) is group.gloo
    headers = _headers_read_ahead if reads_ahead else _headers_in_turn
    previous: Callable[[], Any] | None = None
    for header, preposted in headers(group, programs, timeout):
        if header.kind == HeaderKind.CLOSE:
            break
        if header.kind == HeaderKind.RUN:
            program = programs[header.program_id]
            if preposted is None:
                request_timeout = datetime.timedelta(milliseconds=header.timeout_ms)
                messages = Messages(
                    group,
                    header.request,
                    request_timeout,
                    header.symbol_values,
                    input_layouts=header.input_layouts(program, group.rank),
                )
                preposted = Preposted(messages, {}, {})
            part = placed_part(program, group)
            finish = run_part(program, group, part, preposted.messages, None, preposted)
            if previous is not None:
                previous()
            previous = finish
    if previous is not None:
        previous()


def _headers_in_turn(
    group: Group, programs: dict[int, SplitProgram], timeout: datetime.timedelta
) -> Iterator[tuple[Header, Preposted | None]]:
    """Each header once the request before it has run, a program loaded as its header comes; up to the close."""
    for sequence in itertools.count():
        header = receive_header(group, sequence, timeout)
        if header.kind == HeaderKind.LOAD:
            _load(group, programs, header)
            continue
        yield header, None
        if header.kind == HeaderKind.CLOSE:
            return


def _headers_read_ahead(
    group: Group, programs: dict[int, SplitProgram], timeout: datetime.timedelta
) -> Iterator[tuple[Header, Preposted | None]]:
    """As :func:`_headers_in_turn`, read by a thread of their own that posts each request's receives as its header
    comes, while the request before it still runs (see [Note: receives posted ahead])."""
    ahead: queue.Queue[tuple[Header, Preposted | None] | BaseException] = queue.Queue(maxsize=HEADERS_READ_AHEAD)

    def read() -> None:
        try:
            for header, _ in _headers_in_turn(group, programs, timeout):
                ahead.put((header, _post_receives(group, programs, header)))
        except BaseException as error:  # the rank's loop raises it, as it would have raised it itself
            ahead.put(error)

    threading.Thread(target=read, name="moirai-headers", daemon=True).start()
    while True:
        item = ahead.get()
        if isinstance(item, BaseException):
            raise item
        yield item
        if item[0].kind == HeaderKind.CLOSE:
            return


def _post_receives(group: Group, programs: dict[int, SplitProgram], header: Header) -> Preposted | None:
    """The receives of ``header``'s request on this rank, posted now (None: not a request, one whose program this
    rank lacks, which the rank's loop then names, or one with messages that match by order)."""
    program = programs.get(header.program_id) if header.kind == HeaderKind.RUN else None
    if program is None:
        return None
    part = program.parts[group.rank]
    sources = {transfer.src for transfer in part.receives} | ({0} if part.input_indices else set())
    if any(matches_by_order(group, source) for source in sources):
        return None  # NCCL pairs sends and receives in the order both ends post them: posted in turn
    timeout = datetime.timedelta(milliseconds=header.timeout_ms)
    layouts = header.input_layouts(program, group.rank)
    messages = Messages(group, header.request, timeout, header.symbol_values, input_layouts=layouts)
    first_tag = _FIRST_DATA_TAG + len(program.input_specs)
    inputs = {index: _post_input_recv(messages, program, index) for index in part.input_indices}
    transfers = {t.index: _post_transfer_recv(messages, t, first_tag) for t in part.receives}
    return Preposted(messages, inputs, transfers)


def _load(group: Group, programs: dict[int, SplitProgram], header: Header) -> None:
    if group.secret is None:
        raise DistributedError(
            f"rank {group.rank} was sent a program to load, but this run has no secret to authenticate it "
            f"with (under torchrun, set MOIRAI_RUN_SECRET on every rank); it loads none"
        )
    where = f"rank {group.rank}'s load of program {header.program_id}"
    programs[header.program_id] = decode_program(
        header.payload, where, max_parts=group.world_size
    )  # authenticated by receive_header


def matches_by_order(group: Group, peer: int) -> bool:
    """Whether messages to and from ``peer`` match by posting order (NCCL's), not by tag (gloo, shared memory)."""
    return kind_of(group.wire_device(peer)).messages_in_device_memory


class InputLayout(NamedTuple):
    """How a caller's flat input is laid out, where a rank other than 0 reads it ([Note: a received tensor keeps its
    traced strides]): its strides (None: contiguous), how far past an alignment boundary it starts, and whether it
    requires grad."""

    stride: tuple[int, ...] | None = None
    offset_bytes: int = 0
    requires_grad: bool = False

    @classmethod
    def of(cls, tensor: torch.Tensor) -> InputLayout:
        stride = None if tensor.is_contiguous() else tuple(tensor.stride())
        offset_bytes = tensor.data_ptr() % ALIGNMENT_BYTES
        if offset_bytes % tensor.element_size():  # a buffer's bytes at an odd address: no tensor can start there
            offset_bytes = 0
        return cls(stride, offset_bytes, tensor.requires_grad)

    @classmethod
    def from_wire(cls, value: Any, spec: TensorSpec, where: str) -> InputLayout:
        """A layout as a header's payload holds it, ``[stride or null, offset_bytes, requires_grad]``, checked."""
        stride, offset_bytes, requires_grad = value if isinstance(value, list) and len(value) == 3 else (0, -1, 0)
        strides_fit = stride is None or (
            isinstance(stride, list)
            and len(stride) == len(spec.shape)
            and all(type(step) is int and step >= 0 for step in stride)
        )
        offset_fits = type(offset_bytes) is int and 0 <= offset_bytes < ALIGNMENT_BYTES
        if not (strides_fit and offset_fits and offset_bytes % spec.dtype.itemsize == 0):
            raise DistributedError(f"{where}: {value!r} is not a layout of a {len(spec.shape)}-d {spec.dtype} tensor")
        return cls(None if stride is None else tuple(stride), offset_bytes, requires_grad is True)


@dataclass(frozen=True)
class Header:
    """What rank 0 tells a rank before each message of the protocol: run a request, load a program, heartbeat, close.

    A run's payload holds the request's symbolic dimension values and the layouts of the flat inputs other ranks read
    where they are not a new tensor's (JSON, :class:`InputLayout`), a load's the program
    (:func:`moirai.runtime.program_codec.encode_program`).
    """

    kind: HeaderKind
    program_id: int = 0
    request: int = 0
    timeout_ms: int = 0
    payload: bytes = b""

    @classmethod
    def run(
        cls, program: SplitProgram, program_id: int, request: int, flat_inputs: Sequence[torch.Tensor], timeout_s: float
    ) -> Header:
        values = symbol_values(program, flat_inputs)
        read_elsewhere = sorted({index for part in program.parts[1:] for index in part.input_indices})
        layouts = {index: InputLayout.of(flat_inputs[index]) for index in read_elsewhere}
        unusual = {str(index): list(layout) for index, layout in layouts.items() if layout != InputLayout()}
        payload = json.dumps({"values": values, "layouts": unusual}).encode() if values or unusual else b""
        return cls(HeaderKind.RUN, program_id, request, round(timeout_s * 1000), payload)

    @property
    def _run_payload(self) -> dict[str, Any]:
        return json.loads(self.payload) if self.kind == HeaderKind.RUN and self.payload else {}

    @property
    def symbol_values(self) -> dict[str, int]:
        return self._run_payload.get("values", {})

    def input_layouts(self, program: SplitProgram, rank: int) -> dict[int, InputLayout]:
        """The layouts of the flat inputs that differ from a new tensor's, checked against ``program``'s specs."""
        layouts = self._run_payload.get("layouts", {})
        where = f"rank {rank}: request {self.request}'s header"
        if not isinstance(layouts, dict) or not all(
            key.isdigit() and int(key) < len(program.input_specs) for key in layouts
        ):
            raise DistributedError(f"{where} gives layouts of {sorted(layouts)!r:.80}, not of flat inputs")
        return {
            int(key): InputLayout.from_wire(value, program.input_specs[int(key)], f"{where}, flat input {key}")
            for key, value in layouts.items()
        }

    def __repr__(self) -> str:
        # A load's payload is a program: its size says enough.
        details = [f"program {self.program_id}"]
        if self.kind == HeaderKind.RUN:
            details += [f"request {self.request}", f"limit {self.timeout_ms} ms"]
        if self.payload:
            details.append(f"{len(self.payload)} payload bytes")
        return f"Header({self.kind}, {', '.join(details)})"


def program_for_rank(program: SplitProgram, rank: int) -> SplitProgram:
    """``program`` with only rank ``rank``'s part: the others' graphs (their weights) emptied, their wiring kept."""
    parts = tuple(
        part if part.device == rank else dataclasses.replace(part, graph_module=_empty_module())
        for part in program.parts
    )
    return dataclasses.replace(program, parts=parts)


def load_bytes(program: SplitProgram, rank: int) -> int:
    """The bytes of rank ``rank``'s load (:func:`program_for_rank`, encoded), counted without copying its weights."""
    return encode_program(program_for_rank(program, rank)).num_bytes


def _empty_module() -> fx.GraphModule:
    graph = fx.Graph()
    graph.output(None)
    return fx.GraphModule(torch.nn.Module(), graph)


def send_header(group: Group, sequence: int, dst: int, header: Header, timeout: datetime.timedelta) -> Messages:
    """Send ``header`` as rank ``dst``'s message number ``sequence``; wait for the returned messages' sends."""
    values = {
        "kind": header.kind,
        "program_id": header.program_id,
        "payload_bytes": len(header.payload),
        "request": header.request,
        "timeout_ms": header.timeout_ms,
    }
    fields = [values[name] for name in HEADER_FIELDS]
    digest = hashlib.sha256(header.payload).digest()
    words = fields + _words(digest) + _words(_header_mac(group.secret, dst, sequence, fields, digest))
    control = Messages(group, sequence, timeout, control=True)
    control.send(torch.tensor(words, dtype=_HEADER_DTYPE), dst, 0, "a request header")
    if header.payload:
        control.send(torch.frombuffer(bytearray(header.payload), dtype=torch.uint8), dst, 1, "a request's payload")
    return control


def receive_header(group: Group, sequence: int, timeout: datetime.timedelta) -> Header:
    """Rank ``group.rank``'s header number ``sequence``, checked against the run's secret before its payload is read."""
    control = Messages(group, sequence, timeout, control=True)
    received = control.post_recv((HEADER_WORDS,), _HEADER_DTYPE, 0, 0, "the next request's header")
    words = control.wait_recv(received).tolist()
    count = len(HEADER_FIELDS)
    fields, digest = words[:count], _bytes(words[count : count + DIGEST_WORDS])
    mac = _bytes(words[count + DIGEST_WORDS :])
    if group.secret is not None and not hmac.compare_digest(
        mac, _header_mac(group.secret, group.rank, sequence, fields, digest)
    ):
        raise DistributedError(
            f"rank {group.rank}: header {sequence} failed its authentication check (its HMAC does not match this "
            "run's secret): a process that is not this run's rank 0 sent it; nothing in it was used"
        )
    values = dict(zip(HEADER_FIELDS, fields, strict=True))
    kind = HeaderKind.from_wire(values["kind"], group.rank, sequence)
    payload_bytes = values["payload_bytes"]
    if not 0 <= payload_bytes <= _MAX_PAYLOAD_BYTES:
        raise DistributedError(f"rank {group.rank}: header {sequence} announces a payload of {payload_bytes} bytes")
    payload = b""
    if payload_bytes:
        received = control.wait_recv(control.post_recv((payload_bytes,), torch.uint8, 0, 1, "a request's payload"))
        payload = received.numpy().tobytes()
    if not hmac.compare_digest(hashlib.sha256(payload).digest(), digest):
        raise DistributedError(
            f"rank {group.rank}: the payload of header {sequence} does not match the header's digest; nothing in it "
            "was used"
        )
    return Header(kind, values["program_id"], values["request"], values["timeout_ms"], payload)


def _header_mac(secret: bytes | None, dst: int, sequence: int, fields: Sequence[int], digest: bytes) -> bytes:
    if secret is None:
        return bytes(DIGEST_WORDS * 8)
    message = json.dumps([dst, sequence, list(fields)]).encode() + digest
    return hmac.new(derived_key(secret, "headers"), message, hashlib.sha256).digest()


def _words(digest: bytes) -> list[int]:
    return [int.from_bytes(digest[i : i + 8], "little", signed=True) for i in range(0, len(digest), 8)]


def _bytes(words: Sequence[int]) -> bytes:
    return b"".join(int(word).to_bytes(8, "little", signed=True) for word in words)

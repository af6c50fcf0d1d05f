"""How much of a core one TCP message takes on its sender's side, beyond what the sending process's CPU time shows.

Run on two hosts (``tools/two_hosts.sh``), each pinned to a core of its own, the receiver first::

    tools/two_hosts.sh run b taskset -c 1 python bench/message_core_time.py receive 10.77.0.2 29999 200 262144
    tools/two_hosts.sh run a taskset -c 0 python bench/message_core_time.py send 10.77.0.2 29999 200 262144 5

The receiver listens on its own address on the link only (not every interface) and reads nothing but the bytes it
counts. The sender sends ``count`` messages of ``size`` bytes, each answered by a byte, ``gap_ms`` apart; a probe
process spins on the sender's core all the while. A core's time goes to the sender, to the probe, or to neither: to
work the kernel does on that core for the message outside the sender's time (a link shaper's dequeue, the receiving
end's protocol work on a veth, run in softirq there). Printed per message: the sender's own CPU time, and the core
time the probe lost beyond it. On an unshaped veth both are small; under ``tc tbf`` with a bucket smaller than a GSO
packet they are not (tbf then splits the packets into frames in software, on the sender's core: bench/RESULTS.md
section 15), which is why ``tools/two_hosts.sh shape`` keeps the veth's GSO packets within the bucket.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

PROBE = """
import select, sys, time
sys.stdin.readline()
wall, cpu = time.perf_counter(), time.process_time()
while not select.select([sys.stdin], [], [], 0)[0]:
    for _ in range(20000):
        pass
print(time.perf_counter() - wall, time.process_time() - cpu, flush=True)
"""


def receive(address: str, port: int, count: int, size: int) -> None:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((address, port))
    listener.listen(1)
    peer, _ = listener.accept()
    peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buffer = memoryview(bytearray(max(size, 1)))
    for _ in range(count):
        received = 0
        while received < size:
            received += peer.recv_into(buffer[received:size])
        peer.sendall(b"k")


def send(host: str, port: int, count: int, size: int, gap_ms: float) -> None:
    probe = subprocess.Popen([sys.executable, "-c", PROBE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    os.sched_setaffinity(probe.pid, os.sched_getaffinity(0))
    peer = socket.create_connection((host, port))
    peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    message = b"x" * size
    time.sleep(0.3)
    probe.stdin.write("start\n")
    probe.stdin.flush()
    started_s, cpu_s = time.perf_counter(), time.process_time()
    for _ in range(count):
        if size:
            peer.sendall(message)
            peer.recv(1)
        time.sleep(gap_ms / 1000)
    wall_s, sender_cpu_s = time.perf_counter() - started_s, time.process_time() - cpu_s
    probe.stdin.write("stop\n")
    probe.stdin.flush()
    probe_wall_s, probe_cpu_s = map(float, probe.stdout.readline().split())
    probe.wait()
    lost_s = probe_wall_s - probe_cpu_s - sender_cpu_s
    print(
        f"{size} bytes x {count}: {wall_s / count * 1e3:.3f} ms a message (gap included), sender's CPU "
        f"{sender_cpu_s / count * 1e3:.3f} ms, core time lost beyond it {lost_s / count * 1e3:.3f} ms"
    )


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "receive":
        receive(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    elif len(sys.argv) == 7 and sys.argv[1] == "send":
        send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()

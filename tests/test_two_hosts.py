"""The README's serve.py across two hosts: two network namespaces on this machine joined by a veth pair, each with
its own hostname and /dev/shm (tools/two_hosts.sh), torchrun --nnodes 2 on each, gloo between them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TWO_HOSTS = ROOT / "tools" / "two_hosts.sh"
MASTER_ADDR = "10.77.0.1"  # host a's address inside its namespace (tools/two_hosts.sh)
RUN_TIMEOUT_S = 120


def namespaces_refused() -> str | None:
    """Why this machine cannot make the two hosts, or None."""
    if os.geteuid() != 0:
        return "making network, UTS and mount namespaces needs root"
    missing = [tool for tool in ("unshare", "nsenter") if shutil.which(tool) is None]
    if missing or not (shutil.which("ip") or Path("/usr/sbin/ip").exists()):
        return f"tools/two_hosts.sh needs unshare, nsenter and ip; missing: {missing or ['ip']}"
    trial = subprocess.run(["unshare", "--net", "--uts", "--mount", "true"], capture_output=True, text=True)
    if trial.returncode != 0:
        return f"this machine refuses namespaces: unshare said {trial.stderr.strip()!r}"
    return None


@pytest.fixture
def two_hosts(tmp_path: Path) -> Iterator[dict[str, str]]:
    """The environment that names the two hosts; they are taken down whatever the test does."""
    reason = namespaces_refused()
    if reason is not None:
        pytest.skip(reason)
    environment = {**os.environ, "MOIRAI_TWO_HOSTS_DIR": str(tmp_path / "hosts"), "OMP_NUM_THREADS": "1"}
    environment.pop("GLOO_SOCKET_IFNAME", None)  # moirai must find the interface itself
    try:
        up = subprocess.run([str(TWO_HOSTS), "up"], env=environment, capture_output=True, text=True, timeout=60)
        assert up.returncode == 0, up.stderr
        yield environment
    finally:
        subprocess.run([str(TWO_HOSTS), "down"], env=environment, capture_output=True, timeout=60)


@pytest.mark.slow
def test_readme_serve_script_runs_across_two_hosts(two_hosts: dict[str, str], tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    (script,) = re.findall(r"```python\n(# serve\.py.+?)\n```", readme, re.DOTALL)
    assert "torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 --master-addr" in script
    (tmp_path / "serve.py").write_text(script)
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    hosts = {
        host: subprocess.Popen(
            [str(TWO_HOSTS), "run", host, torchrun, "--nnodes", "2", "--node-rank", str(node_rank)]
            + ["--nproc-per-node", "1", "--master-addr", MASTER_ADDR, "--master-port", "29500", "serve.py"],
            cwd=tmp_path,
            env=two_hosts,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node_rank, host in enumerate("ab")
    }
    finished = {}
    for host, process in hosts.items():
        try:
            finished[host] = process.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"host {host} did not finish within {RUN_TIMEOUT_S} s")  # the fixture ends both hosts
        assert process.returncode == 0, f"host {host} failed: {finished[host][1][-3000:]}"
    assert "served 50 requests, all equal to the model's" in finished["a"][0]
    for node_rank, host in enumerate("ab"):
        # Each rank found the veth end that routes to host a, and said so.
        assert re.search(rf"moirai rank {node_rank}: gloo uses interface mh{host}\w+ \(10\.77\.0\.", finished[host][1])

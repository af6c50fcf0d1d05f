"""The README's serve.py across two hosts: two network namespaces on this machine joined by a veth pair, each with
its own hostname and /dev/shm (tools/two_hosts.sh), torchrun --nnodes 2 on each, gloo between them."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from moirai.cluster.calibration import HostLink

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


def run_on_both_hosts(
    environment: dict[str, str], cwd: Path, *arguments: str, timeout_s: float = RUN_TIMEOUT_S
) -> dict[str, tuple[str, str]]:
    """``torchrun --nnodes 2 ... arguments`` on host a (node 0) and host b (node 1): each host's stdout and stderr,
    after both exited with status 0."""
    hosts = start_on_both_hosts(environment, cwd, *arguments, stderr=subprocess.PIPE)
    finished = {}
    for host, process in hosts.items():
        try:
            finished[host] = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"host {host} did not finish within {timeout_s} s")  # the fixture ends both hosts
        assert process.returncode == 0, f"host {host} failed: {finished[host][1][-3000:]}"
    return finished


# Rank 0 compiles with the calibration file and prints what its cluster says the link between the hosts costs.
PLAN_WITH_CALIBRATION = """
import json, os, warnings
import torch
import moirai

warnings.simplefilter("error", moirai.MoiraiWarning)  # an unmeasured link between the hosts would warn
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]).eval()
x = torch.randn(4, 64)
compiled = moirai.compile(model, ["cpu", "cpu"], example_inputs=(x,), placer="heft", calibration="calibration.json")
y = compiled.run_rank(x)
if int(os.environ["RANK"]) == 0:
    c = compiled.cluster
    with torch.no_grad():
        assert torch.allclose(y, model(x), atol=1e-6)
    print(json.dumps({
        "hosts": [d.host for d in c.devices],
        "latency_s": c.latency_s.tolist(),
        "bandwidth_bytes_per_s": c.bandwidth_bytes_per_s.tolist(),
        "send_cpu_s": c.send_cpu_s.tolist(),
        "recv_cpu_s": c.recv_cpu_s.tolist(),
    }))
"""


@pytest.mark.slow
def test_calibrate_measures_the_link_between_the_hosts_and_rank_0_plans_with_it(
    two_hosts: dict[str, str], tmp_path: Path
) -> None:
    environment = {**two_hosts, "MOIRAI_CACHE_DIR": str(tmp_path / "cache")}
    sweep = ("--max-size-mb", "2", "--repeats", "7")  # sizes up to 2 MB: a slope well above a loaded box's noise
    finished = run_on_both_hosts(
        environment, tmp_path, "-m", "moirai", "calibrate", *sweep, "--save", "calibration.json", timeout_s=240
    )
    assert "rank0 -> rank1" in finished["a"][0] and "rank0 on moirai-host-a, rank1 on moirai-host-b" in finished["a"][0]
    assert finished["b"][0] == ""  # rank 0 alone writes and prints
    from moirai.cluster.calibration import read_host_links

    links = read_host_links(tmp_path / "calibration.json")
    forth, back = (HostLink(f"moirai-host-{s}", f"moirai-host-{d}", "cpu->cpu") for s, d in ("ab", "ba"))
    assert set(links) == {forth, back}  # one rank per host: no link within a host to measure
    for cost in links.values():
        assert 0 < cost.latency_s < 0.1 and cost.bandwidth_bytes_per_s > 1e6
        assert (
            cost.sender_cpu_s + cost.sender_cpu_s_per_byte > 0
            and cost.receiver_cpu_s + cost.receiver_cpu_s_per_byte > 0
        )

    (tmp_path / "plan.py").write_text(PLAN_WITH_CALIBRATION)
    finished = run_on_both_hosts(environment, tmp_path, "plan.py")
    seen = json.loads(finished["a"][0].strip().splitlines()[-1])
    assert seen["hosts"] == ["moirai-host-a", "moirai-host-b"]
    for (a, b), link in (((0, 1), forth), ((1, 0), back)):
        assert seen["latency_s"][a][b] == pytest.approx(links[link].latency_s)
        assert seen["bandwidth_bytes_per_s"][a][b] == pytest.approx(links[link].bandwidth_bytes_per_s)
        assert seen["send_cpu_s"][a][b] == pytest.approx(links[link].sender_cpu_s)
        assert seen["recv_cpu_s"][a][b] == pytest.approx(links[link].receiver_cpu_s)


@pytest.mark.slow
def test_compile_with_auto_calibration_measures_the_link_between_the_hosts_once(
    two_hosts: dict[str, str], tmp_path: Path
) -> None:
    """No `moirai calibrate` first: compile measures the link between the hosts (every rank taking part) and host
    a's own CPU link, caches them on rank 0's host and plans with them; a second run reads them. (The cache starts
    with the runtime's work per request alone: measuring it takes half a minute, the same as on one host, which
    tests/test_calibrate.py checks.)"""
    environment = {**two_hosts, "MOIRAI_CACHE_DIR": str(tmp_path / "cache")}
    seed_host_a_calibration(environment, tmp_path, links=False)
    (tmp_path / "plan.py").write_text(PLAN_WITH_CALIBRATION.replace('"calibration.json"', '"auto"'))
    first = run_on_both_hosts(environment, tmp_path, "plan.py", timeout_s=240)
    assert "moirai: measure links between hosts" in first["a"][1], first["a"][1][-3000:]
    assert "moirai: calibrate links" in first["a"][1] and "moirai: calibrate requests" not in first["a"][1]
    from moirai.cluster.calibration import read_host_links

    cached = [read_host_links(path) for path in (tmp_path / "cache" / "calibration").glob("*.json")]
    (links,) = [found for found in cached if found]  # rank 0's host's cache alone holds them
    forth, back = (HostLink(f"moirai-host-{s}", f"moirai-host-{d}", "cpu->cpu") for s, d in ("ab", "ba"))
    assert set(links) == {forth, back}
    seen = json.loads(first["a"][0].strip().splitlines()[-1])
    assert seen["hosts"] == ["moirai-host-a", "moirai-host-b"]
    for (a, b), link in (((0, 1), forth), ((1, 0), back)):
        assert 0 < links[link].latency_s < 0.1 and links[link].bandwidth_bytes_per_s > 1e6
        assert seen["latency_s"][a][b] == pytest.approx(links[link].latency_s)
        assert seen["bandwidth_bytes_per_s"][a][b] == pytest.approx(links[link].bandwidth_bytes_per_s)
        assert seen["send_cpu_s"][a][b] == pytest.approx(links[link].sender_cpu_s)

    again = run_on_both_hosts(environment, tmp_path, "plan.py")
    assert "measure links between hosts" not in again["a"][1]
    assert json.loads(again["a"][0].strip().splitlines()[-1]) == seen


# Rank 0's planning fails (its placer raises, and its script carries on as if it could recover), its process dies
# (torchrun's launcher on host a, which holds the store, then exits too) or it never ends (host b is then cut off);
# rank 1 writes the error its compile raised.
RANK_0_FAILS_TO_PLAN = """
import importlib, os, signal, time
from pathlib import Path
import torch
import moirai

rank = int(os.environ["RANK"])
if rank == 0:
    def place(*args, **kwargs):
        Path("planning").touch()
        if "HOW" == "raises":
            raise RuntimeError("the placer broke")
        if "HOW" == "dies":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)
    importlib.import_module("moirai.compile").place = place
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]).eval()
try:
    moirai.compile(model, ["cpu", "cpu"], example_inputs=(torch.randn(4, 64),), placer="heft", calibration="none")
except Exception as error:
    Path(f"failed.{rank}").write_text(f"{type(error).__module__}.{type(error).__name__}: {error}")
    if rank == 0:
        time.sleep(600)  # torchrun stops nobody while rank 0 lives
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["raises", "dies", "unplug"])
def test_a_rank_0_that_fails_to_plan_fails_the_other_ranks_naming_it(
    two_hosts: dict[str, str], tmp_path: Path, how: str
) -> None:
    (tmp_path / "plan.py").write_text(RANK_0_FAILS_TO_PLAN.replace("HOW", how))
    hosts = start_on_both_hosts(two_hosts, tmp_path, "plan.py")
    planning, failed = tmp_path / "planning", tmp_path / "failed.1"
    wait_for(lambda: planning.exists() or any(p.poll() is not None for p in hosts.values()), RUN_TIMEOUT_S)
    assert planning.exists(), f"rank 0 did not plan: {[p.communicate()[0][-2000:] for p in hosts.values()]}"
    if how == "unplug":
        subprocess.run([str(TWO_HOSTS), "unplug", "b"], env=two_hosts, check=True, timeout=60)
    # Rank 1 fails long before rank 0's script ends (600 s) or the plan's time limit (1800 s).
    wait_for(failed.exists, 60)
    error = failed.read_text()
    assert error.startswith("moirai.errors.DistributedError: "), error
    if how == "raises":
        assert "rank 0 (host moirai-host-a) failed to plan" in error and "RuntimeError: the placer broke" in error, (
            error
        )
    elif how == "dies":
        assert "the store closed while rank 0 (host moirai-host-a) was planning" in error, error
    else:
        assert "stopped answering" in error and "while rank 0 (host moirai-host-a) was planning" in error, error
        assert not (tmp_path / "failed.0").exists()  # rank 0 plans on: rank 1 did not wait for it
    for host in "ab":
        subprocess.run([str(TWO_HOSTS), "kill", host], env=two_hosts, check=True, timeout=60)
    for process in hosts.values():
        process.communicate(timeout=30)


@pytest.mark.slow
def test_readme_serve_script_runs_across_two_hosts(two_hosts: dict[str, str], tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    (script,) = re.findall(r"```python\n(# serve\.py.+?)\n```", readme, re.DOTALL)
    assert "torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 --master-addr" in script
    (tmp_path / "serve.py").write_text(script)
    environment = {**two_hosts, "MOIRAI_CACHE_DIR": str(tmp_path / "cache")}
    seed_host_a_calibration(environment, tmp_path)
    finished = run_on_both_hosts(environment, tmp_path, "serve.py")
    assert "served 50 requests, all equal to the model's" in finished["a"][0]
    assert "moirai: measure links between hosts" in finished["a"][1], finished["a"][1][-3000:]
    assert "moirai: calibrate" not in finished["a"][1]  # host a's own calibration came from its cache
    for node_rank, host in enumerate("ab"):
        # Each rank found the veth end that routes to host a, and said so.
        assert re.search(rf"moirai rank {node_rank}: gloo uses interface mh{host}\w+ \(10\.77\.0\.", finished[host][1])


# Rank 0 generates with a split Llama, its caches on both hosts, three sequences in flight; host b's rank serves.
# The links between the hosts are measured first (calibration="auto", a cache with host a's own calibration only),
# every rank taking part.
GENERATE_ACROSS_HOSTS = """
import os
import torch
import transformers
import moirai

torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
model = transformers.LlamaForCausalLM(config).eval()
lm = moirai.compile_lm(model, ["cpu", "cpu"], max_batch_size=4, max_seq_len=64, max_prefill=8, placer="round_robin")
if int(os.environ["RANK"]) == 0:
    prompts = torch.randint(0, 512, (3, 10), generator=torch.Generator().manual_seed(5))
    with lm.server() as server:
        tokens = server.generate(prompts, max_new_tokens=12)
    with torch.no_grad():
        expected = model.generate(prompts, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(prompts))
    hosts, used = [d.host for d in lm.compiled.cluster.devices], sorted(set(lm.compiled.plan.placement.tolist()))
    print("hosts", hosts, "devices", used, "EQUAL", torch.equal(tokens, expected))
else:
    moirai.serve_rank(lm.compiled)
"""


# Host a's calibration of its own CPU link (unless LINKS is False) and the runtime's work per request, as its cache
# would hold them: the round-robin plans need no true values, and test_compile_with_auto_calibration... measures
# the link from nothing.
SEED_HOST_CALIBRATION = """
from moirai.cluster.calibration.cache import calibration_cache_path, write_calibration
from moirai.cluster.calibration.fit import TransferCost, link_kind
from moirai.cluster.calibration.request_cost import RequestCost

link = TransferCost(20e-6, 2e9, 10e-6, 1e-10, 10e-6, 1e-10)
links = {link_kind("cpu", "cpu"): link} if LINKS else {}
write_calibration(calibration_cache_path(), links, RequestCost(300e-6, 300e-6))
"""


def seed_host_a_calibration(environment: dict[str, str], cwd: Path, links: bool = True) -> None:
    code = SEED_HOST_CALIBRATION.replace("LINKS", str(links))
    seed = [str(TWO_HOSTS), "run", "a", sys.executable, "-c", code]
    subprocess.run(seed, cwd=cwd, env=environment, check=True, capture_output=True, timeout=60)


@pytest.mark.slow
def test_the_generation_server_runs_across_two_hosts(two_hosts: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "generate.py").write_text(GENERATE_ACROSS_HOSTS)
    environment = {**two_hosts, "MOIRAI_CACHE_DIR": str(tmp_path / "cache")}
    seed_host_a_calibration(environment, tmp_path)
    finished = run_on_both_hosts(environment, tmp_path, "generate.py", timeout_s=240)
    assert "moirai: measure links between hosts" in finished["a"][1], finished["a"][1][-3000:]
    assert "moirai: calibrate" not in finished["a"][1]  # host a's own calibration came from its cache
    hosts = "['moirai-host-a', 'moirai-host-b']"
    assert f"hosts {hosts} devices [0, 1] EQUAL True" in finished["a"][0], finished["a"]


# Rank 0 serves requests, a few in flight at a time, until one fails (host b went away); it writes what failed and
# how many requests were pending, closes its server and exits.
SERVE_UNTIL_A_HOST_GOES = """
import json, os, sys
from pathlib import Path
import torch
import moirai

torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)]).eval()
x = torch.randn(16, 256)
compiled = moirai.compile(model, ["cpu", "cpu"], example_inputs=(x,), placer="round_robin", calibration="none")
if int(os.environ["RANK"]) != 0:
    moirai.serve_rank(compiled, timeout_s=TIMEOUT_S)
    sys.exit(0)
server = compiled.server(timeout_s=TIMEOUT_S, max_in_flight=4)
served, failures = 0, []
while not failures:
    futures = [server.submit(x) for _ in range(4)]
    for future in futures:
        try:
            future.result()
            served += 1
        except moirai.DistributedError as error:
            failures.append(str(error))
    if served >= 8:
        Path("serving").touch()  # the test takes host b away now
try:
    server.close()
except moirai.DistributedError:
    pass  # the failure it closes on is the one the requests had
Path("result.json").write_text(json.dumps({"served": served, "failures": failures}))
"""
GONE_TIMEOUT_S = 5  # what the unplugged host costs to find out: the requests take milliseconds


@pytest.mark.slow
@pytest.mark.parametrize("goes_away", ["kill", "unplug"])
def test_a_host_that_goes_away_fails_the_pending_requests_naming_its_rank(
    two_hosts: dict[str, str], tmp_path: Path, goes_away: str
) -> None:
    """Host b goes away while requests are pending: its processes killed (gloo's connections are reset), or its end
    of the veth taken down (nothing is reset: only timeouts tell)."""
    (tmp_path / "gone.py").write_text(SERVE_UNTIL_A_HOST_GOES.replace("TIMEOUT_S", str(GONE_TIMEOUT_S)))
    hosts = start_on_both_hosts(two_hosts, tmp_path, "gone.py")
    serving, result = tmp_path / "serving", tmp_path / "result.json"
    wait_for(lambda: serving.exists() or any(p.poll() is not None for p in hosts.values()), RUN_TIMEOUT_S)
    assert serving.exists(), f"the hosts stopped before serving: {[p.communicate()[0][-2000:] for p in hosts.values()]}"
    subprocess.run([str(TWO_HOSTS), goes_away, "b"], env=two_hosts, check=True, timeout=60)
    if goes_away == "kill":
        assert hosts["b"].wait(timeout=30) != 0

    # Rank 0 gets its failure within the request timeout and its process ends; torchrun's agent on host a then waits
    # for host b's in its exit barrier, which is torchrun's.
    wait_for(lambda: result.exists() and not rank_processes(two_hosts, "a", "gone.py"), GONE_TIMEOUT_S + 60)
    outcome = json.loads(result.read_text())
    assert outcome["served"] >= 8 and outcome["failures"], outcome
    for failure in outcome["failures"]:
        assert "rank 1 (cpu)" in failure and "host moirai-host-b" in failure, failure
    if goes_away == "unplug":
        # Host b's rank, cut off and alive, stops too: it hears from rank 0 no more, and its store is on host a.
        wait_for(lambda: not rank_processes(two_hosts, "b", "gone.py"), GONE_TIMEOUT_S + 60)
    subprocess.run([str(TWO_HOSTS), "kill", "a"], env=two_hosts, check=True, timeout=60)  # the agent, waiting
    subprocess.run([str(TWO_HOSTS), "kill", "b"], env=two_hosts, check=True, timeout=60)
    output = {host: process.communicate(timeout=30)[0] for host, process in hosts.items()}
    assert "[rank0]: Traceback" not in output["a"], output["a"][-3000:]  # rank 0 caught its failures and exited
    if goes_away == "unplug":
        assert "rank 0 (cpu) hung or died during serving" in output["b"] and "host moirai-host-a" in output["b"]
    for host, text in output.items():
        # The failure is moirai's to report: no gloo traceback or source location, no exception of another library.
        raw = [line for line in text.splitlines() if "gloo" in line.lower() and "gloo uses interface" not in line]
        foreign = [
            name
            for name in re.findall(r"^\[rank\d+\]: ([\w.]+(?:Error|Exception|Failure)): ", text, re.M)
            if not name.startswith("moirai.")
        ]
        assert not raw and not foreign, f"host {host}: {text[-3000:]}"


def start_on_both_hosts(
    environment: dict[str, str], cwd: Path, *arguments: str, stderr: int = subprocess.STDOUT
) -> dict[str, subprocess.Popen[str]]:
    """``torchrun --nnodes 2 ... arguments`` on host a (node 0) and host b (node 1), started (``stderr``: into
    stdout unless piped apart)."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return {
        host: subprocess.Popen(
            [str(TWO_HOSTS), "run", host, torchrun, "--nnodes", "2", "--node-rank", str(node_rank)]
            + ["--nproc-per-node", "1", "--master-addr", MASTER_ADDR, "--master-port", "29500", *arguments],
            cwd=cwd,
            env=environment,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        for node_rank, host in enumerate("ab")
    }


def wait_for(condition: Callable[[], bool], timeout_s: float) -> None:
    """Poll ``condition`` until it holds; fail after ``timeout_s`` (a bound on a hang, not a timing)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"still waiting after {timeout_s} s")
        time.sleep(0.2)


def rank_processes(environment: dict[str, str], host: str, script: str) -> list[int]:
    """The processes on ``host`` (in its network namespace) running ``script``: torchrun's workers, not its agent."""
    holder = (Path(environment["MOIRAI_TWO_HOSTS_DIR"]) / f"{host}.pid").read_text().strip()
    namespace = os.readlink(f"/proc/{holder}/ns/net")
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.readlink(entry / "ns" / "net") == namespace:
                args = (entry / "cmdline").read_bytes().split(b"\0")
                if any(a.endswith(script.encode()) for a in args) and not any(b"torchrun" in a for a in args):
                    found.append(int(entry.name))
        except OSError:
            continue  # it ended meanwhile
    return found

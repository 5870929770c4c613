"""A Ray cluster of a head and worker nodes on one machine, each node in its own network namespace (iproute2): its
own address on a bridge through a veth pair, its own NIC (`eth0`), its own hostname (a UTS namespace) and its own
temp dir (so its own node-local weights cache). The root namespace holds the bridge's address, where the S3
server and the control plane listen for every node. Faults are real: a node's processes killed, its link cut.

Needs root (network namespaces); `netns_permitted()` says whether this process may create them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager, suppress
from dataclasses import dataclass

import httpx

GCS_PORT, DASHBOARD_PORT = 6379, 8265  # each node has its own ports: Ray's defaults collide with nothing
NIC = "eth0"  # the node's interface, as on a real node
# The GCS marks a node dead after this many missed health checks, one every HEALTH_CHECK_MS, each given as long
# to answer: a cut-off node is noticed within about twice their product (Ray's defaults, 3 s period, 10 s
# timeout, 5 misses, take over a minute).
HEALTH_CHECK_MS, HEALTH_CHECK_MISSES = 500, 4
DETECTION_BOUND_S = 15.0  # what the tests hold detection to: measured 8.2 s for a cut link on 2 busy cores
KILL_TIMEOUT_S = 30.0  # how long a node's killed processes may take to be gone


class NodeExited(RuntimeError):
    """A node's `ray start --block` ended."""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def netns_permitted() -> str | None:
    """None when this process may create network namespaces, else why not."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"mtprobe{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as e:
        return f"`ip netns add` is not permitted here: {e.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


@dataclass
class Node:
    name: str  # also its hostname
    netns: str
    address: str
    host_veth: str  # the veth end on the bridge: down is a cut link
    temp_dir: str
    num_cpus: int
    proc: subprocess.Popen | None = None

    @property
    def start_log(self) -> str:  # its `ray start`'s output
        return os.path.join(self.temp_dir, "ray-start.log")


@dataclass
class NetnsCluster:
    tag: str
    bridge: str
    host_address: str  # the root namespace's address on the bridge
    head: Node
    workers: list[Node]
    env: dict[str, str]  # every node's processes get it (the S3 endpoint, say)
    root: str
    # Ray's GCS fault tolerance: the head keeps the cluster's state in this Redis (host:port), so a restarted head
    # finds its nodes, actors and jobs again; None: a restarted head starts a new cluster
    gcs_redis: str | None = None

    @property
    def gcs_address(self) -> str:
        return f"{self.head.address}:{GCS_PORT}"

    @property
    def dashboard_url(self) -> str:
        return f"http://{self.head.address}:{DASHBOARD_PORT}"

    @property
    def nodes(self) -> list[Node]:
        return [self.head, *self.workers]

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def start(self, env: dict[str, str]) -> None:
        """Every node, the head first, then the worker nodes all at once; `env` reaches every node's processes
        (the S3 endpoint, say)."""
        self.env = dict(env)
        self.start_node(self.head)
        for node in self.workers:
            self._spawn(node)
        self.wait_alive({node.address for node in self.workers}, 90)

    def start_node(self, node: Node) -> None:
        """`ray start --block` inside the node's namespace, with its hostname; returns once the node is alive
        in the cluster (for the head: its Jobs API answers)."""
        self._spawn(node)
        if node is self.head:
            _wait_http(f"{self.dashboard_url}/api/version", 90, node)
        else:
            self.wait_alive({node.address}, 90)

    def _spawn(self, node: Node) -> None:
        """Starts the node's `ray start --block`, its output into node.start_log."""
        head = node is self.head
        args = [_ray_bin(), "start", "--block", f"--node-ip-address={node.address}", f"--num-cpus={node.num_cpus}",
                f"--temp-dir={node.temp_dir}", "--disable-usage-stats"]
        if head:
            args += ["--head", f"--port={GCS_PORT}", "--include-dashboard=true", "--dashboard-host=0.0.0.0",
                     f"--dashboard-port={DASHBOARD_PORT}"]
        else:
            args += [f"--address={self.gcs_address}"]
        env = {**os.environ, **self.env, "TMPDIR": node.temp_dir,
               "PATH": f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}",
               # a test cluster on private addresses: no token to hand every node and client
               "RAY_AUTH_MODE": "disabled",
               "RAY_health_check_period_ms": str(HEALTH_CHECK_MS),
               "RAY_health_check_timeout_ms": str(HEALTH_CHECK_MS),
               "RAY_health_check_failure_threshold": str(HEALTH_CHECK_MISSES)}
        if head and self.gcs_redis:
            env["RAY_REDIS_ADDRESS"] = self.gcs_redis
        with open(node.start_log, "ab") as log:
            node.proc = subprocess.Popen(
                ["ip", "netns", "exec", node.netns, "unshare", "--uts", "sh", "-c",
                 f'hostname {node.name} && exec "$@"', "sh", *args],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def alive_addresses(self) -> set[str]:
        """Addresses of the nodes the head counts alive (an empty set while the head is down)."""
        try:
            nodes = httpx.get(f"{self.dashboard_url}/api/v0/nodes", timeout=3).json()["data"]["result"]["result"]
        except (httpx.HTTPError, KeyError, TypeError, ValueError):
            return set()
        return {n["node_ip"] for n in nodes if n["state"] == "ALIVE"}

    def wait_alive(self, addresses: set[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not addresses <= self.alive_addresses():
            for node in self.nodes:
                if node.address in addresses:
                    _check_running(node)
            if time.monotonic() > deadline:
                raise TimeoutError(f"nodes {sorted(addresses)} not alive after {timeout:.0f}s; logs: "
                                   f"{[node.start_log for node in self.nodes]}")
            time.sleep(0.3)

    def wait_dead(self, address: str, timeout: float) -> float:
        """Seconds until the head counts `address` dead."""
        start = time.monotonic()
        while address in self.alive_addresses():
            if time.monotonic() - start > timeout:
                raise TimeoutError(f"node {address} still alive after {timeout:.0f}s")
            time.sleep(0.1)
        return time.monotonic() - start

    def kill_node(self, node: Node) -> int:
        """SIGKILLs every process of the node's namespace (a machine that lost power); returns the kills sent. Again
        until none is left, for up to KILL_TIMEOUT_S: a process forked while the first ones were killed would
        outlive the node, and a killed one stays (holding its ports) until it has exited, which took over 2 s
        here under load."""
        killed, deadline = set(), time.monotonic() + KILL_TIMEOUT_S
        while pids := _pids(node):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{node.name}: processes outlived {KILL_TIMEOUT_S:.0f} s of SIGKILL: "
                                   + "; ".join(_describe(pid) for pid in pids))
            for pid in pids:
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed.update(pids)
            time.sleep(0.1)
        if node.proc is not None:
            with suppress(ProcessLookupError):
                node.proc.wait(10)
        return len(killed)

    def cut(self, node: Node) -> None:
        """The node's link goes down; its processes live on, unreachable."""
        _ip("link", "set", node.host_veth, "down")

    def heal(self, node: Node) -> None:
        _ip("link", "set", node.host_veth, "up")

    def replace_node(self, node: Node) -> None:
        """What a cluster does with a lost node: whatever is left of it goes, and a fresh one joins at its address
        (Ray marked the old one dead: it never rejoins)."""
        self.heal(node)
        self.kill_node(node)
        self.start_node(node)

    def restart_head(self) -> float:
        """The head node loses every process and comes back at its address; returns the seconds until its Jobs
        API answered again."""
        self.kill_node(self.head)
        # a restarted head pod has a fresh /tmp: `ray start --head` would take the killed GCS, a zombie here where
        # nothing reaps it, for a running one at the address it last started
        with suppress(FileNotFoundError):
            os.remove(os.path.join(self.head.temp_dir, "ray_current_cluster"))
        start = time.monotonic()
        self.start_node(self.head)
        return time.monotonic() - start

    def stop(self) -> None:
        """Every node's processes, then the namespaces and the bridge; a process that would not die is raised
        once the rest is gone."""
        unkilled = []
        for node in reversed(self.nodes):
            try:
                self.kill_node(node)
            except RuntimeError as e:
                unkilled.append(e)
        for node in self.nodes:
            with suppress(subprocess.CalledProcessError):
                _ip("netns", "del", node.netns)
            shutil.rmtree(f"/etc/netns/{node.netns}", ignore_errors=True)
        with suppress(subprocess.CalledProcessError):
            _ip("link", "del", self.bridge)
        shutil.rmtree(self.root, ignore_errors=True)
        if unkilled:
            raise unkilled[0]


def _pids(node: Node) -> list[int]:
    """The processes in the node's namespace (zombies hold nothing there and are not listed)."""
    listed = subprocess.run(["ip", "netns", "pids", node.netns], capture_output=True, text=True).stdout
    return [int(pid) for pid in listed.split()]


def _describe(pid: int) -> str:
    """A process's id, state and command line, for an error."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            command = cmdline.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return f"{pid} (gone)"
    return f"{pid} state {state}: {command}"


def _ray_bin() -> str:
    return shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"


def _check_running(node: Node) -> None:
    """Raises if the node's `ray start` exited, with its log's end (the cluster's temp dir goes with it)."""
    if node.proc is not None and node.proc.poll() is not None:
        with open(node.start_log, errors="replace") as log:
            tail = "".join(log.readlines()[-15:])
        raise NodeExited(f"ray start on {node.name} exited with {node.proc.returncode}; {node.start_log} ends:\n"
                         f"{tail}")


def _wait_http(url: str, timeout: float, node: Node) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _check_running(node)
        with suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code < 500:
                return
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f}s; see {node.start_log}")


def _subnet(tag: str) -> str:
    """A /24 in 10.0.0.0/8 from the tag: two clusters on one machine (a bench next to a suite) do not share it."""
    n = int(tag, 16)
    return f"10.{100 + n % 100}.{(n // 100) % 250 + 1}"


def _add_namespace(tag: str, index: int, name: str, bridge: str, subnet: str) -> tuple[str, str, str]:
    netns, host_veth, address = f"mt{tag}-{name}", f"mt{tag}{index}h", f"{subnet}.{10 + index}"
    _ip("netns", "add", netns)
    _ip("link", "add", host_veth, "type", "veth", "peer", "name", f"mt{tag}{index}n")
    _ip("link", "set", f"mt{tag}{index}n", "netns", netns)
    _ip("link", "set", host_veth, "master", bridge, "up")
    _ip("-n", netns, "link", "set", f"mt{tag}{index}n", "name", NIC)
    _ip("-n", netns, "addr", "add", f"{address}/24", "dev", NIC)
    _ip("-n", netns, "link", "set", NIC, "up")
    _ip("-n", netns, "link", "set", "lo", "up")
    # Ray finds a node's own address by the route to a public one: through the bridge, never to loopback
    _ip("-n", netns, "route", "add", "default", "via", f"{subnet}.1")
    return netns, host_veth, address


def _name_service(cluster: NetnsCluster) -> None:
    """What a pod's DNS gives it, as files: `ip netns exec` mounts /etc/netns/<netns>/{hosts,resolv.conf} over
    /etc's. Every node's hostname resolves to its address (Gloo binds to what its own resolves to, else falls back
    to loopback), and each address back to its name: c10d's TCPStore looks up every peer's name as it connects.
    No name server: a lookup of anything else fails at once, where the machine's, unreachable from the
    namespaces, took 10 s per lookup (each worker group's rendezvous waited that long)."""
    names = "".join(f"{node.address} {node.name}\n" for node in cluster.nodes)
    for node in cluster.nodes:
        os.makedirs(f"/etc/netns/{node.netns}", exist_ok=True)
        with open(f"/etc/netns/{node.netns}/hosts", "w") as hosts:
            hosts.write(f"127.0.0.1 localhost\n{names}")
        with open(f"/etc/netns/{node.netns}/resolv.conf", "w") as resolv:
            resolv.write("# no name server: the cluster's names are in hosts\n")


def create_network(worker_nodes: int, worker_cpus: int) -> NetnsCluster:
    """The bridge and the namespaces (no Ray yet)."""
    tag = uuid.uuid4().hex[:4]
    subnet, bridge = _subnet(tag), f"mt{tag}br"
    root = tempfile.mkdtemp(prefix=f"mtn{tag}-")  # short: Ray's unix sockets live under the nodes' temp dirs
    _ip("link", "add", bridge, "type", "bridge")
    cluster = NetnsCluster(tag=tag, bridge=bridge, host_address=f"{subnet}.1", head=None, workers=[],
                           env={}, root=root)
    try:
        _ip("addr", "add", f"{subnet}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        names = ["head", *(f"worker{i}" for i in range(1, worker_nodes + 1))]
        for index, name in enumerate(names):
            netns, veth, address = _add_namespace(tag, index, name, bridge, subnet)
            node = Node(name=name, netns=netns, address=address, host_veth=veth,
                        temp_dir=os.path.join(root, name), num_cpus=0 if index == 0 else worker_cpus)
            os.makedirs(node.temp_dir)
            if index == 0:
                cluster.head = node
            else:
                cluster.workers.append(node)
        _name_service(cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster


@contextmanager
def cluster_network(worker_nodes: int = 2, worker_cpus: int = 1):
    """The bridge and namespaces, torn down (with whatever runs in them) on exit. Start servers the nodes need on
    its host address, then the nodes with `start(env)`. The head has no CPUs: training workers land on worker
    nodes, one per node at 1 CPU each, so a two-worker job crosses a node boundary."""
    cluster = create_network(worker_nodes, worker_cpus=worker_cpus)
    try:
        yield cluster
    finally:
        cluster.stop()

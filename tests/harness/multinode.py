"""A real multi-node Ray cluster on one machine, for the fault tests
(tests/multinode/test_multinode.py).

Each Ray node runs in a network namespace of its own, with its own IP on a private /24, linked
by a veth pair into a bridge in the root namespace (which has an address there too, so that
the test process reaches the nodes and the nodes reach the Redis it runs):

    head   GCS (fault tolerant: its tables in a real redis-server), dashboard, Serve
           controller; no CPU, so no replica lands there
    e1, e2 one CPU and `wim_engine_host: 1` each: one engine replica per node
    r1, r2 `wim_router_host: 1` each: one router per node

and a Serve proxy on every node (`proxy_location: EveryNode`). Each node starts as
docs/deploy.md starts a host, and the cluster runs `deploy/serve_config_multinode.yaml`
(tests/harness/multinode_deploy.py).

Namespaces split the network only: every node sees the same file system (the model, the
code), and `ray start` runs in each. The test process stays out of the cluster: it deploys
and reads Serve's state through the dashboard's REST API and asks questions over HTTP, as an
operator and a client would.

Every process of a node lives in the node's namespace (`ip netns pids`), whoever its parent
is; that is how a node is killed at once (stopped, then SIGKILLed: none sees another die
first) and how teardown knows it left nothing. A run killed before its teardown is swept by
the next one (names carry the pid of the test process that made them).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.harness.live_stack import auth, keys_json, wait_for
from tests.harness.multinode_deploy import ENGINE_HOST, ROUTER_HOST, host_env, serve_config
from tests.harness.process_tree import is_engine_core
from tests.harness.redis_server import RedisServer

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
PREFIX = "wimt"
GCS_PORT = 6379
DASHBOARD_PORT = 8265
HTTP_PORT = 8000
# The default object store takes 30% of the machine's memory per node; the service passes
# little through it.
OBJECT_STORE_BYTES = 100 * 2**20
# The head's logs whose tails a cluster that is not whole in time shows (`wait_whole`).
LOGS_SHOWN_ON_FAILURE = ("gcs_server.out", "dashboard.log")


def run_ip(*args: str, check: bool = True) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def netns_pids(netns: str) -> list[int]:
    """Every process in network namespace `netns` (none if it does not exist)."""
    return [int(pid) for pid in run_ip("netns", "pids", netns, check=False).split()]


def kill_all(netns: str, timeout_s: float = 30) -> None:
    """SIGKILL every process of `netns` at once: all stopped first, so that none reacts to
    another's death (a raylet reaping its workers, an actor exiting cleanly)."""
    deadline = time.monotonic() + timeout_s
    while pids := netns_pids(netns):
        for signum in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes of {netns} survive SIGKILL: {pids}")
        time.sleep(0.1)


def netns_inode(netns: str) -> int:
    """The namespace's identity: it outlives its name while a process is still in it."""
    return os.stat(f"/run/netns/{netns}").st_ino


def processes_in(inodes: set[int]) -> list[int]:
    """Processes in any of the network namespaces `inodes`, named or not."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                link = os.readlink(proc / "ns" / "net")  # "net:[4026532290]"
                if int(link[5:-1]) in inodes:
                    found.append(int(proc.name))
    return found


def _is_engine(pid: int) -> bool:
    with contextlib.suppress(psutil.Error):
        process = psutil.Process(pid)
        return (
            is_engine_core(process)
            or process.name().startswith("VLLM")
            or any("ServeReplica" in part for part in process.cmdline())
        )
    return False


def our_namespaces() -> list[str]:
    return [
        line.split()[0]
        for line in run_ip("netns", "list").splitlines()
        if line.startswith(PREFIX) and line.split()
    ]


def sweep_stale() -> None:
    """Remove what a run killed before its teardown (SIGKILL, a lost CI runner) left:
    namespaces and bridges named after a test process that no longer runs."""
    for netns in our_namespaces():
        match = re.match(rf"{PREFIX}(\d+)-", netns)
        if match and not Path(f"/proc/{match[1]}").exists():
            kill_all(netns)
            run_ip("netns", "del", netns, check=False)
            run_ip("link", "del", f"{PREFIX}{match[1]}b", check=False)
    for link in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        match = re.fullmatch(rf"{PREFIX}(\d+)", link.name)
        if match and link.is_symlink() and not Path(f"/proc/{match[1]}").exists():
            link.unlink()


def free_subnet() -> str:
    """The first three octets of a 10.77.x.0/24 no interface of this machine is on."""
    used = run_ip("-4", "-o", "addr")
    for third in range(1, 255):
        if f" 10.77.{third}." not in used:
            return f"10.77.{third}"
    raise RuntimeError("no free 10.77.x.0/24")


def head_log_tails(ray_dir: Path, lines: int = 40) -> str:
    """The last `lines` of each of the head's `LOGS_SHOWN_ON_FAILURE` under Ray's temp dir."""
    logs = ray_dir / "session_latest" / "logs"
    tails = []
    for name in LOGS_SHOWN_ON_FAILURE:
        path = logs / name
        text = path.read_text(errors="replace") if path.is_file() else "(none)"
        tails.append(f"--- {path}, last {lines} lines:\n" + "\n".join(text.splitlines()[-lines:]))
    return "\n".join(tails)


@dataclass(frozen=True)
class Node:
    name: str  # head, e1, e2, r1, r2
    netns: str
    ip: str
    veth: str  # the root namespace's end of its link: down is a partition
    ray_args: tuple[str, ...]

    @property
    def is_engine_host(self) -> bool:
        return self.name.startswith("e")


class Cluster:
    """The five nodes, Redis and the bridge; `start`, then `teardown` (idempotent, also on
    SIGTERM) leaves nothing of them."""

    def __init__(self, workdir: Path) -> None:
        self.tag = f"{PREFIX}{os.getpid()}"
        self.workdir = workdir
        # Ray's temp dir, through a short link: its AF_UNIX sockets sit deep in it and may not
        # pass 107 bytes, which pytest's temp path under xdist (`popen-gw1/`) already did.
        self.ray_dir = Path(tempfile.gettempdir()) / self.tag
        self.bridge = f"{self.tag}b"
        self.subnet = free_subnet()
        self.bridge_ip = f"{self.subnet}.254"
        head_ip = f"{self.subnet}.1"
        engine = ("--num-cpus", "1", "--resources", json.dumps({ENGINE_HOST: 1}))
        router = ("--num-cpus", "0", "--resources", json.dumps({ROUTER_HOST: 1}))
        worker = ("--address", f"{head_ip}:{GCS_PORT}")
        head = (
            *("--head", "--port", str(GCS_PORT), "--num-cpus", "0"),
            *("--include-dashboard", "true", "--dashboard-host", "0.0.0.0"),
            *("--dashboard-port", str(DASHBOARD_PORT)),
        )
        roles = [
            ("head", 1, head),
            ("e1", 11, worker + engine),
            ("e2", 12, worker + engine),
            ("r1", 21, worker + router),
            ("r2", 22, worker + router),
        ]
        self.nodes = {
            name: Node(name, f"{self.tag}-{name}", f"{self.subnet}.{host}", f"{self.tag}v{i}", args)
            for i, (name, host, args) in enumerate(roles)
        }
        self.redis: RedisServer | None = None
        self.keys_file = workdir / "keys.json"
        # Processes the test process started itself (a restarted GCS): reaped at teardown.
        self.restarted: list[subprocess.Popen[bytes]] = []
        # The cluster's own token (Ray authenticates every RPC and dashboard call): not the
        # machine's ~/.ray/auth_token, which `ray start --head` would otherwise use or write.
        self.token = secrets.token_hex(32)
        self.http = httpx.Client(
            timeout=30, trust_env=False, headers={"Authorization": f"Bearer {self.token}"}
        )

    @property
    def head(self) -> Node:
        return self.nodes["head"]

    @property
    def base(self) -> str:
        """Serve's HTTP proxy, on the head."""
        return f"http://{self.head.ip}:{HTTP_PORT}"

    @property
    def dashboard(self) -> str:
        return f"http://{self.head.ip}:{DASHBOARD_PORT}"

    def client(self, timeout: float = 600) -> httpx.Client:
        return httpx.Client(base_url=self.base, timeout=timeout, headers=auth(), trust_env=False)

    # -- start and stop -------------------------------------------------------------------

    def start(self, redis_binary: str) -> None:
        sweep_stale()
        run_ip("link", "add", self.bridge, "type", "bridge")
        run_ip("addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge)
        run_ip("link", "set", self.bridge, "up")
        for node in self.nodes.values():
            run_ip("netns", "add", node.netns)
            run_ip("link", "add", node.veth, "type", "veth", "peer", "eth0", "netns", node.netns)
            run_ip("link", "set", node.veth, "master", self.bridge, "up")
            run_ip("-n", node.netns, "addr", "add", f"{node.ip}/24", "dev", "eth0")
            run_ip("-n", node.netns, "link", "set", "eth0", "up")
            run_ip("-n", node.netns, "link", "set", "lo", "up")
        self.redis = RedisServer(redis_binary, self.workdir, host=self.bridge_ip).start()
        # The routers' API keys, as a file at the same path on every router host (`host_env`).
        self.keys_file.write_text(keys_json())
        (self.workdir / "ray").mkdir()
        self.ray_dir.symlink_to(self.workdir / "ray")
        # One after another: started side by side, two of four workers timed out joining the
        # head (their node info never came back within Ray's 30 s; 4 December 16:40).
        for node in self.nodes.values():
            self.start_node(node)
        self.wait_for(lambda: self.alive_nodes() == set(self.nodes), "all nodes alive", 120)

    def node_env(self, node: Node) -> dict[str, str]:
        assert self.redis is not None
        role = "head" if node.name == "head" else "engine" if node.is_engine_host else "router"
        env = {**os.environ, **host_env(role, self.token, self.redis.url, self.keys_file)}
        # The workers import this checkout's code, whatever the virtualenv has installed.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        if node.name == "head":
            # GCS fault tolerance: the GCS keeps its tables in Redis and a restarted GCS
            # reads them back (the raylets and workers reconnect meanwhile).
            env["RAY_REDIS_ADDRESS"] = f"{self.redis.host}:{self.redis.port}"
            env["RAY_external_storage_namespace"] = self.tag
        return env

    def start_node(self, node: Node) -> None:
        """`ray start` in the node's namespace (again, after `kill_node`); it returns once
        the node's daemons run."""
        argv = [
            *("ip", "netns", "exec", node.netns, RAY, "start"),
            *("--node-ip-address", node.ip, "--temp-dir", str(self.ray_dir)),
            *("--object-store-memory", str(OBJECT_STORE_BYTES), "--disable-usage-stats"),
            # No log monitor: it streams the node's logs to drivers, and this cluster has none
            # (the test process talks HTTP), while it scans the log folder every 0.1 s, CPU
            # that five nodes on two shared cores miss (docs/testing.md).
            *("--include-log-monitor", "False"),
            *node.ray_args,
        ]
        if node.name == "head":
            assert self.redis is not None
            # The GCS keeps its tables in the password-protected Redis (`node_env`).
            argv += ["--redis-username", "default", "--redis-password", self.redis.password]
        if node.name == "head":
            # `ray start --head` refuses to start where a raylet names its address: it looks
            # through this machine's processes, where the other nodes' raylets run too (a
            # head on a host of its own sees none), unless its temp dir names no cluster.
            (self.ray_dir / "ray_current_cluster").unlink(missing_ok=True)
        log = self.workdir / f"ray-start-{node.name}.log"
        with log.open("ab") as out:
            done = subprocess.run(
                argv, env=self.node_env(node), stdout=out, stderr=subprocess.STDOUT, timeout=180
            )
        if done.returncode != 0:
            raise RuntimeError(f"ray start on {node.name} failed:\n{log.read_text()[-3000:]}")

    def kill_node(self, node: Node) -> None:
        """Every process of the node (raylet, workers, EngineCore, ...) SIGKILLed at once."""
        kill_all(node.netns)

    def kill_gcs(self) -> Callable[[], None]:
        """SIGKILL the head's GCS alone (raylets, workers, Serve and the dashboard run on);
        returns what starts it again as it was (same command, environment and directory),
        reading its tables back from Redis."""
        (gcs,) = [
            process
            for process in map(psutil.Process, netns_pids(self.head.netns))
            if process.name() == "gcs_server"
        ]
        argv, env, cwd = gcs.cmdline(), gcs.environ(), gcs.cwd()
        gcs.kill()
        gcs.wait(10)

        def restart() -> None:
            log = self.workdir / "gcs-restarted.log"
            with log.open("ab") as out:
                self.restarted.append(
                    subprocess.Popen(
                        ["ip", "netns", "exec", self.head.netns, *argv],
                        env=env,
                        cwd=cwd,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )

        return restart

    def gcs_running(self) -> bool:
        return any(
            process.name() == "gcs_server"
            for process in map(psutil.Process, netns_pids(self.head.netns))
        )

    def _redis_rule(self, action: str, node: Node) -> None:
        assert self.redis is not None
        to = ("to", self.redis.host, "ipproto", "tcp", "dport", str(self.redis.port))
        run_ip("-n", node.netns, "rule", action, *to, "blackhole")

    def cut_from_redis(self, node: Node) -> None:
        """A partition between the node and Redis alone: its packets to Redis are dropped
        (connections open hang, new ones fail), every other link works."""
        self._redis_rule("add", node)

    def reconnect_redis(self, node: Node) -> None:
        self._redis_rule("del", node)

    def restart_redis(self, down_s: float) -> None:
        """Redis restarted as a supervisor restarts a persistent one: its data written as it
        stops (`SHUTDOWN SAVE`), down `down_s`, started again reading it back. (The test's
        server keeps no other persistence; docs/deploy.md's appends every write.)"""
        assert self.redis is not None
        with self.redis.client() as client:
            client.shutdown(save=True)
        self.redis.stop()
        time.sleep(down_s)  # the restart's length: part of the fault, not a wait
        self.redis.start()

    def cut(self, node: Node) -> None:
        """A network partition: the node's link goes down; its processes run on."""
        run_ip("link", "set", node.veth, "down")

    def restore(self, node: Node) -> None:
        run_ip("link", "set", node.veth, "up")

    @staticmethod
    def engines_ended(node: Node, timeout_s: float) -> bool:
        """Whether the node's engine replicas (Serve replica workers and vLLM's EngineCore,
        which runs the model) ended within `timeout_s`, without a kill. (Ray's per-node daemons
        outside the raylet's tree, such as its log monitor, live on until the node is
        restarted.)"""
        deadline = time.monotonic() + timeout_s
        while any(map(_is_engine, netns_pids(node.netns))):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)
        return True

    def teardown(self) -> None:
        self.http.close()
        for node in self.nodes.values():
            kill_all(node.netns)
            run_ip("netns", "del", node.netns, check=False)
        run_ip("link", "del", self.bridge, check=False)
        for process in self.restarted:
            process.wait(10)  # killed with its namespace
        if self.redis is not None:
            self.redis.stop()
        self.ray_dir.unlink(missing_ok=True)

    def leftovers(self) -> list[str]:
        """What of this cluster still exists (nothing after `teardown`)."""
        left = [f"netns {ns}" for ns in our_namespaces() if ns.startswith(f"{self.tag}-")]
        if run_ip("link", "show", self.bridge, check=False):
            left.append(f"bridge {self.bridge}")
        if self.redis is not None and self.redis.process is not None:
            left.append(f"redis-server {self.redis.process.pid}")
        if self.ray_dir.is_symlink():
            left.append(f"link {self.ray_dir}")
        return left

    # -- the cluster's state, through the dashboard --------------------------------------

    def raylets(self) -> dict[str, str]:
        """The raylets the GCS counts alive: node id -> node name. A node started again has a
        new id, and its old raylet counts alive until the GCS finds it gone."""
        response = self.http.get(f"{self.dashboard}/api/v0/nodes", params={"limit": 100})
        if response.status_code != 200:
            return {}
        by_ip = {node.ip: node.name for node in self.nodes.values()}
        return {
            row["node_id"]: by_ip[row["node_ip"]]
            for row in response.json()["data"]["result"]["result"]
            if row["state"] == "ALIVE" and row["node_ip"] in by_ip
        }

    def alive_nodes(self) -> set[str]:
        """Names of the nodes the GCS counts alive."""
        return set(self.raylets().values())

    def deploy(self, *, router_memory: int | None = None) -> None:
        """`deploy/serve_config_multinode.yaml`, as `serve deploy` puts it on a cluster;
        `router_memory` (a router actor option) changes the routers alone: a deploy that
        replaces them."""
        config = serve_config(router_memory=router_memory)
        response = self.http.put(f"{self.dashboard}/api/serve/applications/", json=config)
        assert response.status_code == 200, response.text

    def running(self) -> dict[str, list[dict[str, Any]]]:
        """Deployment -> its RUNNING replicas as Serve's controller details them; {} while
        Serve's state cannot be read (the GCS restarting)."""
        try:
            response = self.http.get(f"{self.dashboard}/api/serve/applications/")
        except httpx.TransportError:
            return {}
        if response.status_code != 200:
            return {}
        app = response.json().get("applications", {}).get("wim")
        if app is None:
            return {}
        return {
            name: [replica for replica in deployment["replicas"] if replica["state"] == "RUNNING"]
            for name, deployment in app["deployments"].items()
        }

    def replicas(
        self, running: dict[str, list[dict[str, Any]]] | None = None
    ) -> dict[str, list[tuple[str, str]]]:
        """Deployment -> its RUNNING replicas (`running`, else read now) as (replica id, node
        name); {} while Serve's state cannot be read (the GCS restarting)."""
        by_ip = {node.ip: node.name for node in self.nodes.values()}
        return {
            name: [
                (replica["replica_id"], by_ip.get(replica["node_ip"], replica["node_ip"]))
                for replica in replicas
            ]
            for name, replicas in (self.running() if running is None else running).items()
        }

    def proxies(self) -> set[str]:
        """The nodes whose Serve proxy is healthy."""
        response = self.http.get(f"{self.dashboard}/api/serve/applications/")
        by_ip = {node.ip: node.name for node in self.nodes.values()}
        return {
            by_ip[proxy["node_ip"]]
            for proxy in response.json()["proxies"].values()
            if proxy["status"] == "HEALTHY" and proxy["node_ip"] in by_ip
        }

    def whole(self) -> bool:
        """Every node alive, on one raylet, with a healthy proxy; two routers on the two router
        nodes and two engines on the two engine nodes, each on a raylet alive now; and the
        routers see both engines ready. Serve lists a replica whose node was killed and
        started again as running, on the node's old raylet, until its health check fails:
        counted, the cluster looked whole just before that router was replaced."""
        running = self.running()
        replicas = self.replicas(running)
        routers = sorted(node for _, node in replicas.get("WiMRouter", []))
        engines = sorted(node for _, node in replicas.get("EngineReplica", []))
        if routers != ["r1", "r2"] or engines != ["e1", "e2"]:
            return False
        raylets = self.raylets()
        if sorted(raylets.values()) != sorted(self.nodes) or self.proxies() != set(self.nodes):
            return False
        if any(r["node_id"] not in raylets for listed in running.values() for r in listed):
            return False
        with self.client(timeout=10) as client:
            response = client.get("/readyz")
            return response.status_code == 200 and len(response.json()["replicas"]) == 2

    def wait_whole(
        self, what: str, timeout: float = 600, also: Callable[[], bool] = lambda: True
    ) -> None:
        """Wait until the cluster is `whole` (and `also` holds). A cluster that is not in time
        fails with the tails of the head's GCS and dashboard logs: pytest keeps only its last
        three runs' temporary directories, and CI keeps none."""
        try:
            self.wait_for(lambda: self.whole() and also(), what, timeout)
        except pytest.fail.Exception as exc:
            pytest.fail(f"{exc.msg}\n{head_log_tails(self.ray_dir)}")

    def node_of(self, deployment: str, replica_id: str) -> str:
        return dict(self.replicas()[deployment])[replica_id]

    @staticmethod
    def wait_for(condition: Callable[[], Any], what: str, timeout: float) -> Any:
        """`tests.harness.live_stack.wait_for`, but any HTTP error counts as "not yet" (a partition
        or a restarting GCS fails requests in more ways than a refused connection), and so does
        a reply without the fields asked for."""
        return wait_for(condition, what, timeout, errors=(httpx.HTTPError, KeyError))

"""Two "nodes" for the multi-node tests: two network namespaces joined by a veth pair, each
with its own address, made by the test (root, `ip netns`) and removed after it. Commands run
inside one with `ip netns exec`; HTTP to a server inside one goes through a small Python
client run there (the test process itself stays in its own namespace).

Where namespaces can't be made (not root, no `ip`), LoopbackNodes gives the same interface on
this host's loopback: two process groups that still meet only over TCP, without the
isolation (QUIRE_TEST_NO_NETNS=1 picks it, to run that path as root)."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys

CLIENT = r"""
import json, sys, urllib.request, urllib.error
method, url, body = sys.argv[1], sys.argv[2], sys.argv[3]
req = urllib.request.Request(url, data=body.encode() if body else None, method=method,
                             headers={"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=float(sys.argv[4])) as r:
        print(r.status, flush=True)
        for line in r:
            print(line.decode().rstrip("\n"), flush=True)
except urllib.error.HTTPError as e:
    print(e.code, flush=True)
    print(e.read().decode(), flush=True)
except Exception as e:
    print("000", flush=True)
    print(repr(e), flush=True)
"""


def unavailable_reason() -> str | None:
    """Why namespaces can't be made here (None: they can)."""
    if os.environ.get("QUIRE_TEST_NO_NETNS") == "1":
        return "QUIRE_TEST_NO_NETNS=1"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"quire-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


class TwoNodes:
    """Namespaces node0 / node1 with addresses addr[0] / addr[1] on one veth link; `port` is
    a master port free on node 0 (its namespace holds nothing else)."""

    port = 29500

    def __init__(self) -> None:
        tag = f"{os.getpid() % 10000}{random.randrange(100)}"
        self.names = [f"quire-n0-{tag}", f"quire-n1-{tag}"]
        subnet = f"10.{random.randrange(100, 250)}.{random.randrange(1, 250)}"
        self.addr = [f"{subnet}.1", f"{subnet}.2"]
        veth = [f"qv0{tag}"[:15], f"qv1{tag}"[:15]]
        steps = [["ip", "netns", "add", self.names[0]], ["ip", "netns", "add", self.names[1]],
                 ["ip", "link", "add", veth[0], "type", "veth", "peer", "name", veth[1]]]
        for ns, dev, addr in zip(self.names, veth, self.addr):
            steps += [["ip", "link", "set", dev, "netns", ns],
                      ["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev],
                      ["ip", "-n", ns, "link", "set", dev, "up"],
                      ["ip", "-n", ns, "link", "set", "lo", "up"]]
        try:
            for step in steps:
                subprocess.run(step, check=True, capture_output=True)
        except subprocess.CalledProcessError:
            self.remove()
            raise

    def inside(self, node: int) -> list[str]:
        """The command prefix that runs in `node`."""
        return ["ip", "netns", "exec", self.names[node]]

    def popen(self, node: int, cmd: list[str], **kwargs) -> subprocess.Popen:
        """`ip netns exec` execs the command: the Popen's pid is the command's."""
        return subprocess.Popen([*self.inside(node), *cmd], **kwargs)

    def http(self, node: int, method: str, url: str, body: dict | None = None,
             timeout: float = 30.0) -> tuple[int, str]:
        """(status, body) of one request made from inside `node` (000: no answer)."""
        out = subprocess.run(
            [*self.inside(node), sys.executable, "-c", CLIENT, method,
             url, json.dumps(body) if body is not None else "", str(timeout)],
            capture_output=True, text=True, timeout=timeout + 30)
        status, _, rest = out.stdout.partition("\n")
        return int(status or 0), rest

    def stream(self, node: int, url: str, body: dict) -> subprocess.Popen:
        """A streaming request from inside `node`: its status, then its lines, on stdout."""
        return subprocess.Popen(
            [*self.inside(node), sys.executable, "-c", CLIENT, "POST",
             url, json.dumps(body), "600"], stdout=subprocess.PIPE, text=True)

    def remove(self) -> None:
        for ns in self.names:  # deleting a namespace deletes its end of the veth pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


class LoopbackNodes(TwoNodes):
    """Both nodes on this host's loopback (see the module's docstring)."""

    def __init__(self) -> None:
        self.names, self.addr = [], ["127.0.0.1", "127.0.0.1"]
        with socket.socket() as a, socket.socket() as b:  # the master port and the next
            a.bind(("127.0.0.1", 0))
            self.port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", self.port + 1))
            except OSError:
                self.port = 29500 + random.randrange(20000)

    def inside(self, node: int) -> list[str]:
        return []

    def remove(self) -> None:
        pass

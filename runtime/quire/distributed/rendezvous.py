"""The step channel between node 0 and the other nodes' workers (multi-node only).

Node 0 listens on master_port + 1 (torch.distributed's store has master_port); each remote
worker connects, says which rank it is, and gets its WorkerSpec back; from then on the
connection carries the steps, as a pipe does for a worker on node 0. A connection, not a
collective, because a worker waits on it for as long as the engine is idle (hours).

Both sides are bounded by --distributed-timeout: node 0 names the ranks that never arrived,
a worker gives up on a node 0 it cannot reach. The channel is authenticated (HMAC,
multiprocessing's authkey: $QUIRE_DISTRIBUTED_KEY, same on every node) but not encrypted:
keep the port inside the group's network (the operator's NetworkPolicy does).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from multiprocessing.connection import Client, Connection, Listener

logger = logging.getLogger(__name__)

KEY_ENV = "QUIRE_DISTRIBUTED_KEY"
HELLO_TIMEOUT_S = 10.0  # a connection that says nothing this long is not one of ours
# The channel idles for hours, and a peer behind a cut link sends no FIN: the kernel's
# keepalive probes find it (silent 5 s, then 4 probes 2 s apart: ~13 s), and unacknowledged
# data gives up after 15 s, so both ends see the channel fail (node 0 fails its requests and
# exits, a headless node exits) instead of waiting on it forever or on gloo's 120 s.
KEEPALIVE = (5, 2, 4)  # idle seconds, seconds between probes, probes
USER_TIMEOUT_MS = 15_000


def authkey() -> bytes:
    return os.environ.get(KEY_ENV, "quire-distributed").encode()


def warn_if_default_key() -> None:
    if not os.environ.get(KEY_ENV):
        logger.warning("the step channel uses the built-in key: any host that reaches this "
                       "port can join the group; set $%s (the same on every node; the "
                       "operator's spec.parallelism.keySecret) or keep the port private",
                       KEY_ENV)


def keep_alive(conn: Connection) -> None:
    """TCP keepalive and a bound on unacknowledged data on the channel's socket (Linux's
    options; where one is missing the channel goes on without it)."""
    import socket
    idle, interval, count = KEEPALIVE
    with socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM) as s:  # a dup
        s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval),
                            ("TCP_KEEPCNT", count), ("TCP_USER_TIMEOUT", USER_TIMEOUT_MS)):
            if hasattr(socket, name):
                s.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def step_port(master_port: int) -> int:
    return master_port + 1


class RemoteWorkers:
    """Node 0's side: accept the other nodes' ranks, each once."""

    def __init__(self, port: int, ranks: list[int], describe_rank) -> None:
        self.expected = set(ranks)
        self.describe_rank = describe_rank  # rank -> "rank 2 (node 1)"
        warn_if_default_key()
        self.listener = Listener(("", port), authkey=authkey(), backlog=len(ranks) + 4)
        logger.info("waiting for %d remote ranks on port %d", len(ranks), port)

    def accept_all(self, timeout: float, spec_for) -> dict[int, Connection]:
        """rank -> connection, once every expected rank has said hello and got
        `spec_for(rank)`; a TimeoutError names the missing ones."""
        conns: dict[int, Connection] = {}
        done = threading.Event()
        errors: list[BaseException] = []

        def accept():
            while not done.is_set() and set(conns) != self.expected:
                try:
                    conn = self.listener.accept()
                except OSError:
                    return  # closed: the deadline passed
                except Exception as e:  # noqa: BLE001 - a stranger (a bad key): keep going
                    logger.warning("refused a connection to the step channel: %s", e)
                    continue
                rank = _hello(conn)
                if rank is None:  # every one of ours says hello: a stranger, or a stalled one
                    logger.warning("refused a step-channel connection that said no hello")
                    conn.close()
                    continue
                if rank not in self.expected or rank in conns:
                    # another node's flags differ (its ranks are not this group's), or two
                    # nodes share a --node-rank: the group can never form, so say why to
                    # both sides at once instead of waiting out --distributed-timeout
                    why = (f"rank {rank} already joined: two nodes have the same --node-rank"
                           if rank in conns else
                           f"rank {rank} is not one of this group's remote ranks "
                           f"{sorted(self.expected)}: --tensor-parallel-size, "
                           f"--pipeline-parallel-size and --nnodes must be the same on every "
                           f"node")
                    try:
                        conn.send(("refused", why))
                    except OSError:
                        pass
                    conn.close()
                    errors.append(RuntimeError(f"the group cannot form: {why}"))
                    break
                try:
                    keep_alive(conn)
                    conn.send(spec_for(rank))
                except OSError as e:
                    errors.append(e)
                    continue
                conns[rank] = conn
            done.set()

        thread = threading.Thread(target=accept, name="quire-rendezvous", daemon=True)
        thread.start()
        done.wait(timeout)
        refusals = [e for e in errors if isinstance(e, RuntimeError)]
        if refusals:
            done.set()
            self.close()
            thread.join(5)
            for conn in conns.values():
                conn.close()
            raise refusals[0]
        if set(conns) != self.expected:
            done.set()
            self.close()
            thread.join(5)
            for conn in conns.values():
                conn.close()
            missing = sorted(self.expected - set(conns))
            raise TimeoutError(
                f"{len(missing)} of {len(self.expected)} remote ranks never arrived within "
                f"{timeout:g} s: {', '.join(map(self.describe_rank, missing))}; start "
                f"`quire serve --headless --node-rank N` with the same model and parallelism "
                f"flags on each other node, with --master-addr reaching this one")
        thread.join(5)
        return conns

    def close(self) -> None:
        try:
            self.listener.close()
        except OSError:
            pass


def _hello(conn: Connection) -> int | None:
    try:
        if not conn.poll(HELLO_TIMEOUT_S):
            return None
        msg = conn.recv()
    except (EOFError, OSError):
        return None
    if isinstance(msg, tuple) and len(msg) == 2 and msg[0] == "hello" and isinstance(msg[1], int):
        return msg[1]
    return None


def connect(addr: str, port: int, rank: int, timeout: float):
    """A worker's side: connect to node 0 (retrying while it is not up yet), say hello, and
    return (connection, the WorkerSpec node 0 sent)."""
    deadline = time.monotonic() + timeout
    delay = 0.1
    while True:
        try:
            conn = Client((addr, port), authkey=authkey())
            break
        except (OSError, EOFError) as e:
            if time.monotonic() + delay > deadline:
                raise TimeoutError(f"rank {rank} could not reach node 0 at {addr}:{port} "
                                   f"within {timeout:g} s ({e}); is --master-addr right and "
                                   f"the leader started?") from None
            time.sleep(delay)
            delay = min(2.0, delay * 2)
    keep_alive(conn)
    conn.send(("hello", rank))
    if not conn.poll(max(1.0, deadline - time.monotonic())):
        raise TimeoutError(f"node 0 at {addr}:{port} took rank {rank}'s hello but sent no "
                           f"spec within {timeout:g} s")
    sent = conn.recv()
    if isinstance(sent, tuple) and len(sent) == 2 and sent[0] == "refused":
        conn.close()
        raise RuntimeError(f"node 0 at {addr}:{port} refused rank {rank}: {sent[1]}")
    return conn, sent



def pin_gloo_interface(master_addr: str) -> None:
    """Gloo binds to the address the hostname resolves to (often 127.0.0.1 in a container);
    across nodes it must use the interface that reaches node 0, as vLLM sets
    GLOO_SOCKET_IFNAME. A value the user set wins."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    ip = _source_address(master_addr)
    name = _interface_with(ip) if ip else None
    if name is None:
        logger.warning("no interface found for the route to %s: gloo picks its own (set "
                       "GLOO_SOCKET_IFNAME if the ranks cannot connect)", master_addr)
        return
    os.environ["GLOO_SOCKET_IFNAME"] = name
    logger.info("gloo uses interface %s (%s), the route to node 0 at %s", name, ip, master_addr)


def _source_address(addr: str) -> str | None:
    """This host's address on the route to addr (a UDP connect sends nothing)."""
    import socket
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def _interface_with(ip: str) -> str | None:
    import fcntl
    import socket
    import struct
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), siocgifaddr,
                                  struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address
            if socket.inet_ntoa(raw[20:24]) == ip:
                return name
    return None

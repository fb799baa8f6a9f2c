"""Small networking helpers: the server's listening socket, and free ports for the benchmarks and tests that start
local servers."""

from __future__ import annotations

import ipaddress
import random
import socket
from pathlib import Path

# Ports the OS never hands out on its own: above Ray's worker ports (10002-19999) and below the kernel's ephemeral
# range, so a port chosen here is not taken a moment later by a process that asks the OS for "any port" (Ray's
# start takes dozens: a bind of the Serve proxy then failed on one of them).
QUIET_LOW = 20000
_given: set[int] = set()  # handed out by this process: two servers started together never share one


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; macOS starts at 49152


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now, outside the OS's ephemeral range where it can be."""
    high = _ephemeral_low()
    if high - QUIET_LOW > 1000:
        for port in random.sample(range(QUIET_LOW, high), 64):
            if port not in _given and _free(port):
                _given.add(port)
                return port
    with socket.socket() as s:  # no quiet range on this machine: the OS picks
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before its model loads: a port in use fails in a second with a clear error (the
    HTTP thread's own bind failed silently after the load, and the server ran on, unreachable). An OSError whose
    message says what to do."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a restart binds at once
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror or e}; pass another --port or stop "
                               "what holds it") from None
    return sock


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or "localhost") names this machine's loopback interface only."""
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]").split("%")[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1, as a dual-stack socket shows an IPv4 bind
    return (mapped or ip).is_loopback

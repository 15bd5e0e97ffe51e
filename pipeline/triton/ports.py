"""Loopback ports: whether one is taken (`pipeline serve` checks before it starts tritonserver), and free ones
for the tests, benchmarks and soak that start their own servers."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int = 3) -> list[int]:
    """n distinct ports that were free on 127.0.0.1 a moment ago (all held at once, so they differ).

    They come from below the kernel's ephemeral range: tritonserver binds them only after its models load,
    and a port from that range could meanwhile become the local end of some client's connection (seen in
    CI as a server that came up without its metrics port).
    """
    low = _ephemeral_low()
    socks = []
    try:
        while len(socks) < n:
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", random.randrange(10_000, low) if low > 11_000 else 0))
            except OSError:
                sock.close()
                continue
            socks.append(sock)
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()

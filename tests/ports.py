"""Free loopback ports for the tests that start a real tritonserver."""

import random
import socket
from pathlib import Path


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

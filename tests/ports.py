"""Free loopback ports for the tests that start a real tritonserver."""

import socket


def free_ports(n: int = 3) -> list[int]:
    """n distinct ports that were free on 127.0.0.1 a moment ago (all held at once, so they differ)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()

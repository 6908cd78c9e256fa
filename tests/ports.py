"""Free localhost ports for tests that start servers and process groups.

A port taken from bind(0) lies in the kernel's ephemeral range, so between the check and the server's own
bind any outgoing connection (an HTTP client, a gloo rendezvous, another test's ZMQ socket) can be given it:
CI saw `ZMQError: Address already in use` on such a port. Ports below that range are never handed out
implicitly, so a port checked free there stays free unless another test picks the same one; a random start
makes that unlikely, and `start_server` retries on that error anyway.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOW_FLOOR = 20000  # below: well-known and registered services a CI machine may run


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(span: int = 1) -> int:
    """A port p with p .. p + span - 1 all free, below the ephemeral range when there is room there."""
    hi = _ephemeral_low() - span
    rng = random.Random()
    for _ in range(500):
        p = rng.randrange(LOW_FLOOR, hi) if hi > LOW_FLOOR + 1000 else rng.randrange(1024, 65535 - span)
        if all(_is_free(p + i) for i in range(span)):
            return p
    raise RuntimeError(f"no {span} adjacent free ports")

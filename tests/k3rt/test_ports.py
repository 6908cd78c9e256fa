"""The tests' port picker stays out of the kernel's ephemeral range (CI lost a server's port to an outgoing
connection between the check and the bind: `ZMQError: Address already in use` on port 58744)."""

from __future__ import annotations

import socket

from tests.ports import _ephemeral_low, free_port


def test_free_ports_lie_below_the_ephemeral_range_and_are_free() -> None:
    low = _ephemeral_low()
    for span in (1, 2):
        for _ in range(20):
            p = free_port(span)
            assert p + span - 1 < low, (p, low)
            for q in range(p, p + span):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", q))

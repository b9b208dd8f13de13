"""Ports for servers that tests start.

`bind(("127.0.0.1", 0))` asks the kernel for an ephemeral port, and Linux hands them
out in a near-sequence: two test processes side by side (tools/run_tests.py runs two)
that each take one, close it and start a server on it a second later were handed the
same port, and one server failed to start ("port ... is in use"). These ports are drawn
at random below the ephemeral range instead, and checked free.
"""

from __future__ import annotations

import random
import socket

LOW, HIGH = 20_000, 32_000  # below Linux's ephemeral range (32768-60999)
_random = random.SystemRandom()


def free_port() -> int:
    """A random port in [LOW, HIGH) that nothing on 127.0.0.1 holds now."""
    for _ in range(1000):
        port = _random.randrange(LOW, HIGH)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{LOW}, {HIGH}) after 1000 tries")

"""Port picking for servers the tests and the launcher start."""

from __future__ import annotations

import socket

import pytest

from resilient.procs import free_ports


@pytest.mark.timeout(30)
def test_ports_picked_together_are_distinct_and_bindable() -> None:
    # 600 draws from the ~16k ports below the ephemeral range collide with
    # near certainty when each is drawn alone; together they must not.
    ports = free_ports(600)
    assert len(set(ports)) == 600
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ports[0]))

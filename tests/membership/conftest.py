"""Fixtures of the membership tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from membership.nodes import NodeRendezvous


@pytest.fixture
def made() -> Iterator[list[NodeRendezvous]]:
    """Every node rendezvous a test makes is closed after it."""
    out: list[NodeRendezvous] = []
    yield out
    for r in out:
        r.close()

"""Fixtures the chaos tests share: helper processes stopped at teardown, and netns
testbeds taken down even when a test fails."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from chaos.testbed import NetnsTestbed
from tests.chaos import _net


@pytest.fixture
def procs() -> Iterator[_net.Procs]:
    procs = _net.Procs()
    try:
        yield procs
    finally:
        procs.close()


def _netns(hosts: int, rails: int) -> Iterator[NetnsTestbed]:
    testbed = NetnsTestbed(hosts, rails)
    try:
        yield testbed.up()
    finally:
        testbed.down()


@pytest.fixture
def netns_2x2() -> Iterator[NetnsTestbed]:
    yield from _netns(2, 2)


@pytest.fixture
def netns_3x2() -> Iterator[NetnsTestbed]:
    yield from _netns(3, 2)

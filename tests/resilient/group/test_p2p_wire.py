"""Point-to-point wire tags (resilient.group.p2p_wire): pure logic."""

from __future__ import annotations

import pytest

from resilient.group.p2p_wire import DATA_ANY, READY, wire_tag
from resilient.links.ledger import GROUP_SHIFT, SALT_SHIFT


@pytest.mark.timeout(10)
def test_point_to_point_tags_leave_the_salt_and_slot_bits_free() -> None:
    seen = set()
    for user in (0, 1, 5, (1 << 21) - 1, 1 << 21, (1 << 31) - 1, -1, -(1 << 31)):
        for kind in (READY, DATA_ANY):
            tag = wire_tag(user, kind)
            assert 0 <= tag < 1 << GROUP_SHIFT and (tag >> SALT_SHIFT) & 0xF == 0
            seen.add(tag)
    assert len(seen) == 16  # distinct user tags and kinds stay distinct

"""The C fast path is built here, and a build without it says so loudly.

Without a C compiler the install still works (setup.py makes the extension
optional) and every schedule runs in Python: correct, and tens of percent slower on
two rails. That must never go unnoticed: this suite fails, and the backend warns."""

from __future__ import annotations

import logging
import os

import pytest

from resilient.backend import warn_if_no_fast_path
from resilient.config import DataPlaneConfig
from resilient.links import native_steps

pytestmark = pytest.mark.timeout(30)


def test_the_c_fast_path_is_built() -> None:
    if os.environ.get("RESILIENT_NATIVE_IO") == "0":
        pytest.skip("RESILIENT_NATIVE_IO=0: the fast path is off on purpose")
    assert native_steps.available(), (
        "the C fast path is OFF: resilient.links._stepio was not built (no C compiler at "
        "install?); every collective runs in Python. Install a C compiler and reinstall."
    )


def test_a_build_without_it_warns_once_per_group_and_names_the_way_out(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(native_steps, "_stepio", None)
    with caplog.at_level(logging.WARNING, logger="resilient.backend"):
        assert warn_if_no_fast_path(3, DataPlaneConfig())
    (record,) = caplog.records
    assert "rank 3" in record.getMessage() and "fast path is OFF" in record.getMessage()
    assert "RESILIENT_NATIVE_IO=0" in record.getMessage()
    # Off on purpose: nothing to say.
    assert not warn_if_no_fast_path(3, DataPlaneConfig(native_io=False))


def test_a_build_with_it_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    if not native_steps.available():
        pytest.skip("not built here (test_the_c_fast_path_is_built fails)")
    with caplog.at_level(logging.WARNING, logger="resilient.backend"):
        assert not warn_if_no_fast_path(0, DataPlaneConfig())
    assert not caplog.records

"""Entering a testbed host's network namespace from inside a process (no imports of
torch or the library: it must run while the process is still single-threaded)."""

from __future__ import annotations

import ctypes
import os

__all__ = ["enter_netns"]


def enter_netns(name: str | None, *, own_sysfs: bool = False) -> None:
    """Move this (still single-threaded) process into network namespace ``name``.

    Threads started afterwards (torch's, gloo's) inherit it. No-op for None.
    ``own_sysfs`` also mounts a sysfs of the new namespace on ``/sys`` in a private
    mount namespace, as ``ip netns exec`` does: sysfs shows the interfaces of the
    namespace that mounted it, so without this ``/sys/class/net`` (where the NIC
    monitor reads operstate) would still list the root namespace's interfaces.
    """
    if name is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        _check(libc.setns(fd, 0x40000000), f"setns into {name}")  # CLONE_NEWNET
    finally:
        os.close(fd)
    if own_sysfs:
        _check(libc.unshare(0x00020000), "unshare(CLONE_NEWNS)")
        # Private from here on, so the remount below never leaks to the root namespace.
        _check(libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None), "mount --make-rprivate /")
        _check(libc.umount2(b"/sys", 2), "umount -l /sys")  # MNT_DETACH
        _check(libc.mount(name.encode(), b"/sys", b"sysfs", 0, None), "mount sysfs on /sys")


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")

"""Call checks: every rank agrees on a call before its data moves, or fails it.

- ``exchange``: :class:`CallChecks`, the signature exchange ahead of the data: a
  row (the call's signature, small payloads, health news, clocks) sent when the
  call is made and read when it runs, so a mismatch fails on every rank before any
  data phase starts.
- ``control_mesh``: :class:`ControlMesh`, that exchange's all-gather over the
  control links, with little Python.
- ``elision``: :class:`ElidedCalls`, running a call checked by the digest in its
  data messages instead of a row exchange while the group is quiet, and deciding
  when calls may elide.

Modules inside the package import each other by module path, never from here.
"""

from resilient.check.control_mesh import ControlMesh
from resilient.check.elision import CHECKED, ElidedCalls
from resilient.check.exchange import CallChecks, Payload, Ticket

__all__ = ["CHECKED", "CallChecks", "ControlMesh", "ElidedCalls", "Payload", "Ticket"]

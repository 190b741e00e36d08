"""The cache key of a scenario's fault-free reference run.

A cached reference is reused only while everything that shapes that run is the
same: the scenario's ``[job]`` table (all of it but ``warm_spares``, which the
reference never starts, and ``timeout_s``, which only decides whether a run gets
cached at all), the script and its arguments, the library's Python code
(``resilient``, ``membership``, ``recovery``), the built C extension
(``resilient/links/_stepio*.so``: the rail passes it moves are the same sums in a
different order only if it changes), and torch's version (its kernels round
differently from release to release). The scenario's faults and expectations do
not take part: the reference runs none of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
from collections.abc import Iterable
from pathlib import Path
from typing import Final

from chaos.scenario import Scenario

__all__ = ["CODE_PACKAGES", "ROOT", "reference_key", "torch_version"]

ROOT: Final = Path(__file__).resolve().parent.parent
CODE_PACKAGES: Final = ("resilient", "membership", "recovery")
_EXTENSION_GLOB: Final = "resilient/links/_stepio*.so"
# Fields of [job] that leave the fault-free run as it is (see the module docstring).
_NOT_IN_KEY: Final = frozenset({"warm_spares", "timeout_s"})


def torch_version() -> str:
    """torch's ``__version__`` as its installed distribution records it (read without
    importing torch, which takes seconds); "absent" where it is not installed."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _job_fields(scenario: Scenario, script_args: Iterable[str]) -> str:
    fields = {k: v for k, v in dataclasses.asdict(scenario.job).items() if k not in _NOT_IN_KEY}
    if scenario.job.nodes == 1:
        # One launcher, as before these keys existed: its cached references stay valid.
        del fields["nodes"], fields["ranks_per_node"]
    # The arguments as the script gets them (--steps and --seed added).
    fields["args"] = tuple(script_args)
    return repr(sorted(fields.items()))


def reference_key(
    scenario: Scenario,
    script: str,
    script_args: Iterable[str],
    *,
    root: Path = ROOT,
    torch: str | None = None,
) -> str:
    """The key (24 hex digits) of the fault-free run of ``scenario`` with ``script``
    run with ``script_args``, the code under ``root`` and torch version ``torch``
    (default: the installed one)."""
    h = hashlib.sha256()

    def part(label: str, data: bytes) -> None:
        # Label and length first, so no two different inputs hash the same bytes.
        h.update(f"{label}\0{len(data)}\0".encode())
        h.update(data)

    part("job", _job_fields(scenario, script_args).encode())
    part("torch", (torch if torch is not None else torch_version()).encode())
    files = [p for pkg in CODE_PACKAGES for p in sorted((root / pkg).rglob("*.py"))]
    files += sorted(root.glob(_EXTENSION_GLOB))
    for path in files:
        with contextlib.suppress(OSError):
            part(path.relative_to(root).as_posix(), path.read_bytes())
    with contextlib.suppress(OSError):
        part("script", Path(script).read_bytes())
    return h.hexdigest()[:24]

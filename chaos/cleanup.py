"""Finding and removing the kernel objects that chaos runs and benchmarks leave behind.

What the library creates in the kernel, and how each is known to be its own:

=========== ===================================================================
netns       ``rsl-<id>-sw`` and ``rsl-<id>-h<N>``: a :class:`~chaos.testbed.NetnsTestbed`
            (its veths, bridges, the injectors' tbf qdiscs and iptables rules
            live inside them and go with them)
link        ``rsl<id>m``: the testbed's leg on its management bridge, the one veth
            of the root namespace (it goes with the switch namespace as a rule)
qdisc       a root htb qdisc with handle ``7273:`` on a root-namespace device: the
            rate limits of ``benchmarks/allreduce.py --rail-rate-mbit`` on ``lo``
iptables    a root-namespace filter rule whose comment is ``rsl-<pid>...``. None is
            made today (the injectors' rules live inside the hosts' namespaces and
            carry the same comment); the sweep keeps a future one from leaking
cgroup      ``rsl-<pid>-<what>`` under the CPU controller's root: the ``slow-cpu``
            fault's quota (:mod:`chaos.cpu_throttle`); its processes go back to the
            root cgroup (full speed) before it is deleted
=========== ===================================================================

An owner record (a JSON file in :func:`owner_dir` holding the builder's pid) claims
a testbed or a qdisc; an iptables rule names its owner's pid in its comment, a
cgroup in its name. An object whose owner is dead, or that no record claims, is a
leftover;
:func:`remove_leftovers` deletes those (with ``force``, those of live owners too)
and nothing without our name, handle or comment.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shlex
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from chaos import _sh, cpu_throttle
from resilient.errors import ChaosError
from resilient.procs import pid_alive

__all__ = [
    "PREFIX",
    "QDISC_MAJOR",
    "Leftover",
    "claim_qdisc",
    "our_objects",
    "owner_dir",
    "release_qdisc",
    "remove_leftovers",
    "rule_comment",
]

logger = logging.getLogger(__name__)

PREFIX: Final = "rsl-"
# "rs" in ASCII: the handle tells our qdiscs from anyone else's (tc has no names).
QDISC_MAJOR: Final = "7273"
_ROOT_IF: Final = re.compile(r"rsl[0-9a-f]{4}m")
_COMMENT_OWNER: Final = re.compile(rf"{PREFIX}(\d+)(?:\D.*)?")
_CGROUP_OWNER: Final = re.compile(rf"{PREFIX}(\d+)-.*")


@dataclass(frozen=True, slots=True)
class Leftover:
    """One removed object: its kind (netns, link, qdisc, iptables, record), name, owner."""

    kind: str
    name: str
    owner: int | None  # the owner's pid; None when no record or comment names one

    def __str__(self) -> str:
        who = "no owner record" if self.owner is None else f"owner pid {self.owner}"
        return f"{self.kind} {self.name} ({who})"


def owner_dir() -> Path:
    """Where owner records live (``$RESILIENT_CHAOS_STATE`` or the temp dir)."""
    return Path(os.environ.get("RESILIENT_CHAOS_STATE", tempfile.gettempdir())) / "resilient-chaos"


def write_record(path: Path, record: dict[str, Any]) -> bool:
    """Create owner record ``path``, whole at once; False when it exists already.

    Written aside and hard-linked into place, so a concurrent sweep never reads half
    a record and deletes a live object as unclaimed.

    Raises:
        OSError: the directory cannot be created or written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    aside = path.parent / f".{path.stem}.{os.getpid()}.tmp"
    aside.write_text(json.dumps(record))
    try:
        os.link(aside, path)
    except FileExistsError:
        return False
    finally:
        aside.unlink(missing_ok=True)
    return True


def rule_comment() -> list[str]:
    """The iptables match that marks a rule as this process's (``rsl-<pid>``)."""
    return ["-m", "comment", "--comment", f"{PREFIX}{os.getpid()}"]


# -- listing and deleting ----------------------------------------------------------------
def list_netns() -> list[str]:
    out = _sh.run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _root_links() -> list[str]:
    out = _sh.run(["ip", "-o", "link", "show"], check=False)
    # "5: rsl1a2bm@if4: <BROADCAST,...": the name sits between the first ": " and "@".
    return [line.split(": ", 2)[1].split("@")[0] for line in out.splitlines() if ": " in line]


def _our_qdiscs() -> list[str]:
    """Root-namespace devices whose root qdisc is ours (htb, handle ``7273:``)."""
    out = _sh.run(["tc", "qdisc", "show"], check=False) if shutil.which("tc") else ""
    devs = []
    for line in out.splitlines():
        tok = line.split()  # qdisc htb 7273: dev lo root refcnt 2 ...
        if tok[:3] == ["qdisc", "htb", f"{QDISC_MAJOR}:"] and tok[3:4] == ["dev"] and "root" in tok:
            devs.append(tok[4])
    return devs


def _our_rules() -> list[tuple[list[str], int]]:
    """Root-namespace filter rules with an ``rsl-<pid>`` comment: (``-A`` spec, pid)."""
    ipt = shutil.which("iptables")
    out = _sh.run([ipt, "-w", "5", "-t", "filter", "-S"], check=False) if ipt else ""
    rules = []
    for line in out.splitlines():
        with contextlib.suppress(ValueError):  # an odd quote: not a rule we wrote
            tok = shlex.split(line)
            if tok[:1] == ["-A"] and "--comment" in tok[:-1]:
                comment = tok[tok.index("--comment") + 1]
                if m := _COMMENT_OWNER.fullmatch(comment):
                    rules.append((tok, int(m.group(1))))
    return rules


def our_objects(*, others: bool = True) -> list[str]:
    """Every kernel object with our name, handle or comment (a soak's leak check
    compares these before and after its run); without ``others``, not those whose
    owner is another live process (a run going on beside this one)."""
    objects: list[tuple[str, int | None]] = [
        (f"netns {n}", None) for n in list_netns() if n.startswith(PREFIX)
    ]
    objects += [(f"link {n}", None) for n in _root_links() if _ROOT_IF.fullmatch(n)]
    objects += [(f"qdisc {d}", None) for d in _our_qdiscs()]
    objects += [(f"iptables {' '.join(rule)}", pid) for rule, pid in _our_rules()]
    with contextlib.suppress(ChaosError, OSError):
        root, _ = cpu_throttle.cpu_root()
        for child in root.iterdir():
            if m := _CGROUP_OWNER.fullmatch(child.name):
                objects.append((f"cgroup {child.name}", int(m.group(1))))
    owners: dict[str, int] = {}  # read after listing: an owner records before it makes
    for _, record in _records():
        holder = int(record["pid"])
        if record.get("kind", "testbed") == "qdisc":
            owners[f"qdisc {record['dev']}"] = holder
        else:
            owners.update({f"netns {n}": holder for n in record["netns"]})
            owners[f"link {record['root_if']}"] = holder
    me = os.getpid()
    kept = []
    for name, named in objects:
        owner = named if named is not None else owners.get(name)
        if others or owner is None or owner == me or not pid_alive(owner):
            kept.append(name)
    return sorted(kept)


def delete_testbed(names: list[str], root_if: str) -> None:
    for name in reversed(names):
        _sh.run(["ip", "netns", "delete", name], check=False)
    # Deleting the switch namespace destroys the veth pair; this catches a half-built one.
    _sh.run(["ip", "link", "delete", root_if], check=False)


def _records() -> Iterator[tuple[Path, dict[str, Any]]]:
    owners = owner_dir()
    for path in sorted(owners.glob("*.json")) if owners.is_dir() else []:
        try:
            record = json.loads(path.read_text())
            int(record["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            logger.warning("ignoring unreadable owner record %s", path)
            continue
        yield path, record


# -- the sweep ---------------------------------------------------------------------------
@dataclass
class _Sweep:
    """One pass: kernel objects listed first, then the records read (see remove_leftovers)."""

    force: bool
    netns: list[str]
    links: list[str]
    qdiscs: list[str]
    removed: list[Leftover]

    def dead(self, pid: int) -> bool:
        return self.force or not pid_alive(pid)

    def testbed(self, path: Path, record: dict[str, Any]) -> set[str]:
        """Delete the record's testbed if its owner is dead; the names it claims."""
        pid, names, root_if = int(record["pid"]), list(record["netns"]), str(record["root_if"])
        if self.dead(pid):
            delete_testbed(names, root_if)
            self.removed += [Leftover("netns", n, pid) for n in names if n in self.netns]
            self.removed += [Leftover("link", root_if, pid)] if root_if in self.links else []
            self._drop(path, pid)
        return {*names, root_if}

    def qdisc(self, path: Path, record: dict[str, Any]) -> set[str]:
        pid, dev = int(record["pid"]), str(record["dev"])
        if self.dead(pid):
            if dev in self.qdiscs:
                self._del_qdisc(dev, pid)
            self._drop(path, pid)
        return {f"qdisc:{dev}"}

    def _del_qdisc(self, dev: str, pid: int | None) -> None:
        # With the handle, the kernel refuses to delete a root qdisc that is not ours.
        _sh.run(["tc", "qdisc", "del", "dev", dev, "root", "handle", f"{QDISC_MAJOR}:"],
                check=False)  # fmt: skip
        self.removed.append(Leftover("qdisc", f"{QDISC_MAJOR}: on {dev}", pid))

    def _drop(self, path: Path, pid: int) -> None:
        with contextlib.suppress(OSError):
            path.unlink()
            self.removed.append(Leftover("record", str(path), pid))

    def unclaimed(self, claimed: set[str]) -> None:
        """Delete what carries our name or handle but no record claims."""
        still_ns = set(list_netns())  # a testbed may have been taken down meanwhile
        for name in self.netns:
            if name.startswith(PREFIX) and name not in claimed and name in still_ns:
                _sh.run(["ip", "netns", "delete", name], check=False)
                self.removed.append(Leftover("netns", name, None))
        still_links = set(_root_links())  # listed after: a switch namespace takes its veth
        for name in self.links:
            if _ROOT_IF.fullmatch(name) and name not in claimed and name in still_links:
                _sh.run(["ip", "link", "delete", name], check=False)
                self.removed.append(Leftover("link", name, None))
        for dev in self.qdiscs:
            if f"qdisc:{dev}" not in claimed:
                self._del_qdisc(dev, None)

    def rules(self) -> None:
        ipt = shutil.which("iptables") or "iptables"  # _our_rules() finds none without it
        for spec, pid in _our_rules():
            if self.dead(pid):
                # "-A CHAIN rest" deletes as "-D CHAIN rest": the very rule, no other.
                _sh.run([ipt, "-w", "5", "-t", "filter", "-D", *spec[1:]], check=False)
                self.removed.append(Leftover("iptables", " ".join(spec), pid))


def remove_leftovers(*, force: bool = False) -> list[Leftover]:
    """Delete what the library made in the kernel and whose owner process is gone.

    ``force`` also deletes the objects of live owners (a run still going loses its
    testbed). Returns what was removed, records included; nothing without root.
    Objects without our name, handle or comment are never touched.
    """
    if not _sh.is_root():
        return []
    # Listed before the records are read: an owner writes its record before it makes
    # the object, so every object listed here is claimed by a record read below.
    # (Listed after, an object being built meanwhile would look unclaimed.)
    sweep = _Sweep(force, list_netns(), _root_links(), _our_qdiscs(), [])
    claimed: set[str] = set()
    for path, record in _records():
        try:
            if record.get("kind", "testbed") == "qdisc":
                claimed |= sweep.qdisc(path, record)
            else:
                claimed |= sweep.testbed(path, record)
        except (KeyError, TypeError, ValueError):
            logger.warning("ignoring unreadable owner record %s", path)
    sweep.unclaimed(claimed)
    sweep.rules()
    sweep.removed += [Leftover("cgroup", p, pid) for p, pid in cpu_throttle.sweep(sweep.dead)]
    if sweep.removed:
        logger.warning("removed %d object(s) left by an earlier chaos run or benchmark",
                       len(sweep.removed))  # fmt: skip
    return sweep.removed


# -- the qdisc of a benchmark's rate limits ----------------------------------------------
def _qdisc_record(dev: str) -> Path:
    return owner_dir() / f"qdisc-{dev}.json"


def claim_qdisc(dev: str) -> None:
    """Record this process as the owner of the root qdisc it is about to add on ``dev``.

    Leftovers of dead owners are removed first. The qdisc must then use handle
    ``7273:`` (:data:`QDISC_MAJOR`), so that a sweep knows it.

    Raises:
        ChaosError: not root, or ``dev`` carries a root qdisc already (a live run's,
            or one the library did not make: that one is never replaced).
    """
    _sh.require_root(f"a qdisc on {dev}")
    remove_leftovers()
    out = _sh.run(["tc", "qdisc", "show", "dev", dev, "root"], check=False)
    first = out.split("\n", 1)[0].split()
    if first[2:3] not in ([], ["0:"]):  # handle 0: is the kernel's default qdisc
        owner = "a live run" if first[2] == f"{QDISC_MAJOR}:" else "someone else"
        raise ChaosError(f"{dev} has a qdisc already ({owner}): {' '.join(first)}")
    record = {"kind": "qdisc", "pid": os.getpid(), "dev": dev}
    try:
        claimed = write_record(_qdisc_record(dev), record)
    except OSError as exc:
        raise ChaosError(f"cannot write the owner record of {dev}'s qdisc: {exc}") from exc
    if not claimed:
        raise ChaosError(f"{_qdisc_record(dev)} exists: another run shapes {dev}")


def release_qdisc(dev: str) -> None:
    """Delete this process's root qdisc on ``dev`` and its record (idempotent)."""
    _sh.run(["tc", "qdisc", "del", "dev", dev, "root", "handle", f"{QDISC_MAJOR}:"],
            check=False)  # fmt: skip
    path = _qdisc_record(dev)
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        if int(json.loads(path.read_text())["pid"]) == os.getpid():
            path.unlink()

"""Kernel objects for the cleanup tests, made under a test name (``zzt<hex>``) that the
library never uses, and always removed again (:meth:`Objects.close` in a fixture's
``finally``), whatever the test did to them."""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
from pathlib import Path

from chaos import _sh
from chaos.cleanup import QDISC_MAJOR, owner_dir


class Objects:
    """Veths, namespaces, iptables chains and owner records made by one test."""

    def __init__(self) -> None:
        self.tag = f"zzt{secrets.token_hex(2)}"
        self._veths: list[str] = []
        self._netns: list[str] = []
        self._chains: list[str] = []
        self._records: list[Path] = []

    def veth(self, name: str) -> str:
        """A veth pair in the root namespace: ``name`` and ``name`` + ``p``."""
        _sh.run(["ip", "link", "add", "name", name, "type", "veth", "peer", "name", f"{name}p"])
        self._veths.append(name)
        return name

    def netns(self, name: str) -> str:
        _sh.run(["ip", "netns", "add", name])
        self._netns.append(name)
        return name

    def record(self, name: str, record: dict[str, object]) -> Path:
        path = owner_dir() / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))
        self._records.append(path)
        return path

    def chain(self, rules: list[list[str]]) -> str:
        """A root-namespace filter chain no packet reaches (nothing jumps to it) holding
        ``rules`` (each the match and target after ``-A CHAIN``)."""
        chain = self.tag.upper()
        ipt = str(shutil.which("iptables"))
        _sh.run([ipt, "-w", "5", "-N", chain])
        self._chains.append(chain)
        for rule in rules:
            _sh.run([ipt, "-w", "5", "-A", chain, *rule])
        return chain

    def close(self) -> None:
        ipt = shutil.which("iptables") or "iptables"
        for chain in self._chains:
            _sh.run([ipt, "-w", "5", "-F", chain], check=False)
            _sh.run([ipt, "-w", "5", "-X", chain], check=False)
        for name in self._veths:
            _sh.run(["ip", "link", "delete", name], check=False)
        for name in self._netns:
            _sh.run(["ip", "netns", "delete", name], check=False)
        for path in self._records:
            with contextlib.suppress(OSError):
                path.unlink()


def add_qdisc(dev: str, handle: str) -> None:
    """A root htb qdisc on ``dev`` with ``handle`` (``7273:`` is the library's); it goes
    with the device."""
    _sh.run(["tc", "qdisc", "add", "dev", dev, "root", "handle", handle, "htb"])


def root_qdisc(dev: str) -> str:
    """``kind handle`` of ``dev``'s root qdisc (``noqueue 0:`` for a fresh veth)."""
    out = _sh.run(["tc", "qdisc", "show", "dev", dev, "root"], check=False).split()
    return " ".join(out[1:3])


def ours(dev: str) -> bool:
    return root_qdisc(dev) == f"htb {QDISC_MAJOR}:"


def chain_rules(chain: str) -> list[str]:
    out = _sh.run([str(shutil.which("iptables")), "-w", "5", "-S", chain], check=False)
    return [line for line in out.splitlines() if line.startswith("-A ")]

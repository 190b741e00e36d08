"""TLS (CA, client certificates) and user/password auth against a real etcd.

Every server and client is stopped/closed by a fixture, so a failing test leaves
no etcd process or temp dir behind. Time bounds asserted here are loose on purpose
(a loaded 2-core machine): they separate "failed at once" from "retried until the
budget ran out", not milliseconds.
"""

from __future__ import annotations

import queue
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pyetcd import etcdrpc

from membership.etcd_client import EtcdClient
from membership.server import EmbeddedEtcd, ServerTLS
from resilient.config import EtcdConfig
from resilient.errors import ConfigError, EtcdUnavailable, MembershipError
from tests._certs import TestCerts, issue_cert, make_certs, make_jwt_keys

ROOT_PW = "root-secret"
USER = "alice"
USER_PW = "alice-secret"
PREFIX = "/resilient/"

StartEtcd = Callable[..., EmbeddedEtcd]
MakeClient = Callable[..., EtcdClient]


# -- fixtures ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def certs_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="resilient-certs-") as d:
        yield Path(d)


@pytest.fixture(scope="module")
def certs(certs_dir: Path) -> TestCerts:
    return make_certs(certs_dir / "good")


@pytest.fixture(scope="module")
def other_certs(certs_dir: Path) -> TestCerts:
    """A second, unrelated CA with its own server and client certs."""
    return make_certs(certs_dir / "other")


def _server_tls(certs: TestCerts) -> ServerTLS:
    return ServerTLS(
        cert=certs.server_cert,
        key=certs.server_key,
        ca=certs.ca.cert,
        client_cert=certs.probe_cert,
        client_key=certs.probe_key,
    )


@pytest.fixture(scope="module")
def secure_etcd(certs: TestCerts) -> Iterator[EmbeddedEtcd]:
    """TLS, --client-cert-auth and user/password auth: root plus alice (rw on PREFIX)."""
    with EmbeddedEtcd(fsync=False, tls=_server_tls(certs)) as server:
        server.enable_auth(ROOT_PW, user=USER, password=USER_PW, prefix=PREFIX)
        yield server


@pytest.fixture(scope="module")
def plain_auth_etcd() -> Iterator[EmbeddedEtcd]:
    """Plaintext http with user/password auth on."""
    with EmbeddedEtcd(fsync=False) as server:
        server.enable_auth(ROOT_PW, user=USER, password=USER_PW, prefix=PREFIX)
        yield server


@pytest.fixture
def start_etcd() -> Iterator[StartEtcd]:
    """Start an EmbeddedEtcd (fsync off) with the given arguments; all stop at teardown."""
    started: list[EmbeddedEtcd] = []

    def start(**kwargs: Any) -> EmbeddedEtcd:
        server = EmbeddedEtcd(fsync=False, **kwargs)
        started.append(server)  # before start(): a half-started server is stopped too
        server.start()
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def make_client() -> Iterator[MakeClient]:
    """Build an EtcdClient from EtcdConfig keyword arguments; all close at teardown."""
    clients: list[EtcdClient] = []

    def make(**kwargs: Any) -> EtcdClient:
        kwargs.setdefault("request_timeout_s", 2.0)
        kwargs.setdefault("retry_budget_s", 10.0)
        client = EtcdClient(EtcdConfig(**kwargs))
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def _tls_kwargs(server: EmbeddedEtcd, certs: TestCerts) -> dict[str, Any]:
    return {
        "endpoints": server.endpoints,
        "ca_cert": certs.ca.cert,
        "cert": certs.client_cert,
        "key": certs.client_key,
    }


def _key(name: str) -> str:
    return f"{PREFIX}security/{name}-{time.monotonic_ns()}"


def _timed(fn: Callable[[], object]) -> tuple[BaseException | None, float]:
    """Run ``fn``; return what it raised (None if nothing) and how long it took."""
    t0 = time.monotonic()
    try:
        fn()
    except Exception as exc:
        return exc, time.monotonic() - t0
    return None, time.monotonic() - t0


def _cause_text(exc: BaseException) -> str:
    cause = exc.__cause__
    details = getattr(cause, "details", None)
    return str(details() if callable(details) else cause)


# -- the certificate helper --------------------------------------------------------------
@pytest.mark.timeout(30)
def test_make_certs_is_fast_and_complete(tmp_path: Path) -> None:
    t0 = time.monotonic()
    made = make_certs(tmp_path / "c")
    assert time.monotonic() - t0 < 2.0
    for path in (made.ca.cert, made.server_cert, made.server_key, made.client_cert):
        assert Path(path).stat().st_size > 0
    assert made.client_cn == "resilient-client"


@pytest.mark.timeout(30)
def test_server_tls_needs_client_cert_and_key_together(certs: TestCerts) -> None:
    with pytest.raises(ConfigError, match="together"):
        ServerTLS(
            cert=certs.server_cert,
            key=certs.server_key,
            ca=certs.ca.cert,
            client_cert=certs.probe_cert,
        )


# -- TLS + client certificate + password: the working path -----------------------------
@pytest.mark.timeout(60)
def test_tls_client_cert_and_password_put_get_lease_watch(
    secure_etcd: EmbeddedEtcd, certs: TestCerts, make_client: MakeClient
) -> None:
    assert secure_etcd.url.startswith("https://")
    client = make_client(**_tls_kwargs(secure_etcd, certs), user=USER, password=USER_PW)
    key = _key("kv")

    client.put(key, b"v1")
    got = client.get(key)
    assert got is not None and got.value == b"v1"

    lease = client.grant_lease(10)
    client.put(key + "/leased", b"x", lease=lease)
    assert client.refresh_lease(lease) > 0

    events: queue.Queue[Any] = queue.Queue()
    watch_id = client.add_watch_prefix(key, events.put, start_revision=None)
    try:
        client.put(key, b"v2")
        deadline = time.monotonic() + 10.0
        seen: list[tuple[str, bytes]] = []
        while (key, b"v2") not in seen and time.monotonic() < deadline:
            item = events.get(timeout=max(0.0, deadline - time.monotonic()))
            assert not isinstance(item, BaseException), item
            seen += [(ev.key.decode(), bytes(ev.value)) for ev in item.events]
        assert (key, b"v2") in seen
    finally:
        client.cancel_watch(watch_id)

    client.revoke_lease(lease)
    assert client.get(key + "/leased") is None
    kvs, _ = client.get_prefix(key)
    assert [kv.key for kv in kvs] == [key]


@pytest.mark.timeout(60)
def test_user_cannot_write_outside_its_prefix(
    secure_etcd: EmbeddedEtcd, certs: TestCerts, make_client: MakeClient
) -> None:
    client = make_client(**_tls_kwargs(secure_etcd, certs), user=USER, password=USER_PW)
    exc, elapsed = _timed(lambda: client.put("/elsewhere/key", b"x"))
    assert isinstance(exc, MembershipError) and not isinstance(exc, EtcdUnavailable), exc
    assert "permission denied" in str(exc)
    assert elapsed < 5.0  # refused at once, not retried until the 10 s budget


@pytest.mark.timeout(60)
def test_client_cert_common_name_is_the_etcd_user(
    secure_etcd: EmbeddedEtcd, certs: TestCerts, make_client: MakeClient, tmp_path: Path
) -> None:
    # With --client-cert-auth etcd takes a token-less client to be the user named by
    # its certificate's CN: issuing a cert for CN=alice grants alice's rights.
    cert, key = issue_cert(certs.ca, tmp_path, "alice", cn=USER, kind="client")
    client = make_client(endpoints=secure_etcd.endpoints, ca_cert=certs.ca.cert, cert=cert, key=key)
    name = _key("by-cn")
    client.put(name, b"cn")
    got = client.get(name)
    assert got is not None and got.value == b"cn"


# -- refused connections: typed errors, within the bound ---------------------------------
@pytest.mark.timeout(60)
def test_plain_http_client_against_tls_server_fails_with_typed_error(
    secure_etcd: EmbeddedEtcd, make_client: MakeClient
) -> None:
    plain = tuple(url.replace("https://", "http://") for url in secure_etcd.endpoints)
    client = make_client(
        endpoints=plain, user=USER, password=USER_PW, request_timeout_s=1.0, retry_budget_s=2.0
    )
    exc, elapsed = _timed(lambda: client.get(_key("plain")))
    # The server just closes the socket, which looks like a restarting etcd: retried,
    # but only within the budget.
    assert isinstance(exc, EtcdUnavailable), exc
    assert elapsed < 2.0 + 1.0 + 3.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["wrong_ca", "foreign_client_cert", "no_client_cert"])
def test_tls_certificate_problems_fail_at_once(
    case: str,
    secure_etcd: EmbeddedEtcd,
    certs: TestCerts,
    other_certs: TestCerts,
    make_client: MakeClient,
) -> None:
    kwargs: dict[str, Any] = {
        "wrong_ca": {
            "ca_cert": other_certs.ca.cert,
            "cert": other_certs.client_cert,
            "key": other_certs.client_key,
        },
        "foreign_client_cert": {
            "ca_cert": certs.ca.cert,
            "cert": other_certs.client_cert,
            "key": other_certs.client_key,
        },
        "no_client_cert": {"ca_cert": certs.ca.cert},
    }[case]
    client = make_client(endpoints=secure_etcd.endpoints, user=USER, password=USER_PW, **kwargs)
    exc, elapsed = _timed(lambda: client.get(_key(case)))
    # A configuration error, not an outage: MembershipError, not EtcdUnavailable, and
    # not retried for the whole 10 s budget.
    assert isinstance(exc, MembershipError) and not isinstance(exc, EtcdUnavailable), exc
    assert "TLS" in str(exc)
    assert elapsed < 5.0


@pytest.mark.timeout(60)
def test_wrong_password_is_rejected_at_once(
    secure_etcd: EmbeddedEtcd, certs: TestCerts, make_client: MakeClient
) -> None:
    client = make_client(**_tls_kwargs(secure_etcd, certs), user=USER, password="wrong")
    exc, elapsed = _timed(lambda: client.get(_key("badpw")))
    assert isinstance(exc, MembershipError) and not isinstance(exc, EtcdUnavailable), exc
    assert "authentication failed" in str(exc)
    assert elapsed < 5.0


@pytest.mark.timeout(60)
def test_client_without_credentials_cannot_read(
    secure_etcd: EmbeddedEtcd, certs: TestCerts, make_client: MakeClient
) -> None:
    writer = make_client(**_tls_kwargs(secure_etcd, certs), user=USER, password=USER_PW)
    key = _key("secret")
    writer.put(key, b"s")
    # A valid client cert but no password: etcd sees the cert's CN, which is no user.
    anonymous = make_client(**_tls_kwargs(secure_etcd, certs))
    exc, elapsed = _timed(lambda: anonymous.get(key))
    assert isinstance(exc, MembershipError) and not isinstance(exc, EtcdUnavailable), exc
    assert "permission denied" in str(exc)
    assert elapsed < 5.0


# -- plaintext + password ------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_password_auth_over_plaintext(
    plain_auth_etcd: EmbeddedEtcd, make_client: MakeClient
) -> None:
    # gRPC refuses per-call credentials on a plaintext channel; EtcdClient sends the
    # token as metadata only, so user/password works without TLS too.
    client = make_client(endpoints=plain_auth_etcd.endpoints, user=USER, password=USER_PW)
    key = _key("plain-auth")
    client.put(key, b"p")
    got = client.get(key)
    assert got is not None and got.value == b"p"

    anonymous = make_client(endpoints=plain_auth_etcd.endpoints)
    exc, elapsed = _timed(lambda: anonymous.get(key))
    assert isinstance(exc, MembershipError) and not isinstance(exc, EtcdUnavailable), exc
    assert "user name is empty" in _cause_text(exc)
    assert elapsed < 5.0


# -- expired and stale tokens ------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_expired_token_is_renewed_by_reauthenticating(
    start_etcd: StartEtcd, certs: TestCerts, make_client: MakeClient
) -> None:
    server = start_etcd(tls=_server_tls(certs), extra_args=["--auth-token-ttl=1"])
    server.enable_auth(ROOT_PW, user=USER, password=USER_PW, prefix=PREFIX)
    client = make_client(**_tls_kwargs(server, certs), user=USER, password=USER_PW)
    key = _key("ttl")
    client.put(key, b"1")
    first = client.raw()

    time.sleep(2.5)  # idle past the 1 s token TTL (etcd checks expiry once a second)
    got = client.get(key)
    assert got is not None and got.value == b"1"
    assert client.raw() is not first, "the token should have expired and been renewed"

    # Several threads hitting the expired token at once must all succeed: only the
    # first re-authenticates, none closes the client another one just built.
    time.sleep(2.5)
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for j in range(10):
                client.put(f"{key}/t{i}", str(j))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    assert client.count_prefix(f"{key}/t") == 6


@pytest.mark.timeout(90)
def test_client_rides_through_a_restart_of_a_tls_auth_server(
    start_etcd: StartEtcd, certs: TestCerts, make_client: MakeClient
) -> None:
    server = start_etcd(tls=_server_tls(certs))
    server.enable_auth(ROOT_PW, user=USER, password=USER_PW, prefix=PREFIX)
    client = make_client(**_tls_kwargs(server, certs), user=USER, password=USER_PW)
    key = _key("restart")
    client.put(key, b"before")

    server.restart(0)  # the health probe must pass with auth on and client certs required

    # etcd 3.5 re-creates simple tokens when it replays its WAL, so the old token may
    # still be good; either way the call must go through within its budget.
    client.put(key, b"after")
    got = client.get(key)
    assert got is not None and got.value == b"after"


@pytest.mark.timeout(60)
def test_jwt_token_stale_after_auth_change_is_renewed(
    start_etcd: StartEtcd, make_client: MakeClient, tmp_path: Path
) -> None:
    priv, pub = make_jwt_keys(tmp_path)
    server = start_etcd(
        extra_args=[f"--auth-token=jwt,pub-key={pub},priv-key={priv},sign-method=ES256"]
    )
    server.enable_auth(ROOT_PW, user=USER, password=USER_PW, prefix=PREFIX)
    client = make_client(endpoints=server.endpoints, user=USER, password=USER_PW)
    key = _key("jwt")
    client.put(key, b"1")
    first = client.raw()

    # Any user/role change bumps etcd's auth revision; a JWT carries the revision it
    # was issued at, and etcd then refuses it ("auth: revision in header is old").
    admin = make_client(endpoints=server.endpoints, user="root", password=ROOT_PW)
    admin.call(
        "add user bob",
        lambda c: c.authstub.UserAdd(
            etcdrpc.AuthUserAddRequest(name="bob", password="bob-secret"), 2.0, metadata=c.metadata
        ),
    )

    exc, elapsed = _timed(lambda: client.put(key, b"2"))
    assert exc is None, exc
    assert elapsed < 5.0
    assert client.raw() is not first
    got = client.get(key)
    assert got is not None and got.value == b"2"


# -- EtcdCluster.enable_auth ---------------------------------------------------------------
@pytest.mark.timeout(60)
def test_enable_auth_validates_and_refuses_a_second_call(
    start_etcd: StartEtcd, make_client: MakeClient
) -> None:
    server = start_etcd()
    with pytest.raises(ConfigError):
        server.enable_auth("")
    with pytest.raises(ConfigError):
        server.enable_auth(ROOT_PW, user=USER)
    server.enable_auth(ROOT_PW)
    with pytest.raises(MembershipError):
        server.enable_auth(ROOT_PW, timeout_s=3.0)
    root = make_client(endpoints=server.endpoints, user="root", password=ROOT_PW)
    root.put("/anything", b"root may write anywhere")

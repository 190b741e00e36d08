"""Mesh steps moved in C (resilient.links.native_steps): frames the Python socket pair reads and
writes alike, and every way a step stops handed back so the pair finishes it. Real
TCP connections on loopback; the far end is a Python SocketPair or a raw socket."""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from resilient.links import native_steps
from resilient.links.ledger import OpLedger
from resilient.links.socket_connect import PairError
from resilient.links.socket_engine import Engine, SocketWork
from resilient.links.socket_frames import HEADER as _HEADER
from resilient.links.socket_frames import DigestMismatch
from resilient.links.socket_pair import SocketPair
from tests._dist import run_world, stop_c_steps_early

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not native_steps.available(), reason="resilient.links._stepio is not built"),
]

BIG = 8 << 20  # more than loopback's socket buffers take at once
WAIT = timedelta(seconds=20)


@pytest.fixture
def ends() -> Iterator[tuple[SocketPair, socket.socket]]:
    """A quiet SocketPair (the C step's end) and the raw socket at the other end."""
    listener = socket.create_server(("127.0.0.1", 0))
    far = socket.create_connection(listener.getsockname(), timeout=10)
    near, _ = listener.accept()
    listener.close()
    for s in (near, far):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    engine = Engine()
    pair = SocketPair(near, engine)
    yield pair, far
    pair.shutdown()
    far.close()
    engine.close()


@pytest.fixture
def python_end() -> Iterator[Callable[[socket.socket], SocketPair]]:
    """Makes the far end a Python SocketPair; shut down after the test, passed or not."""
    made: list[SocketPair] = []

    def make(far: socket.socket) -> SocketPair:
        made.append(SocketPair(far, Engine()))
        return made[-1]

    yield make
    for peer in made:
        peer.shutdown()
        peer.engine.close()


def _bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _step(pair: SocketPair) -> native_steps.Step:
    return native_steps.Step([pair], [OpLedger()])


def _send(step: native_steps.Step, tag: int, digest: int, data: torch.Tensor) -> None:
    step.send(0, tag, digest, memoryview(data.numpy()), data.data_ptr(), 0, data.numel())


def _recv(step: native_steps.Step, tag: int, digest: int, into: torch.Tensor) -> None:
    step.recv(0, tag, digest, memoryview(into.numpy()), into.data_ptr(), 0, into.numel())


def _finish(works: list[Any]) -> None:
    """Wait for what a stopped step handed back (DONE and finished works need none)."""
    for w in works:
        assert w is not None, "a message was not begun: the test expected it moved"
        if isinstance(w, SocketWork):
            w.wait(WAIT)


def _frame(tag: int, digest: int, body: bytes) -> bytes:
    return _HEADER.pack(tag, len(body), digest) + body


def test_frames_go_both_ways_between_a_c_step_and_a_python_pair(ends: Any, python_end: Any) -> None:
    pair, far = ends
    peer = python_end(far)
    out = [_bytes(BIG, 1), _bytes(100, 2), _bytes(0, 3)]
    back = [_bytes(1 << 20, 4), _bytes(17, 5)]
    got_there = [torch.zeros_like(t) for t in out]
    got_here = [torch.zeros_like(t) for t in back]
    step = _step(pair)
    for i, t in enumerate(out):
        _send(step, 10 + i, 0xD1, t)
    for i, t in enumerate(got_here):
        _recv(step, 20 + i, 0xD2, t)

    def python_side() -> None:
        recvs = [peer.recv([t], 0, 10 + i, 0xD1) for i, t in enumerate(got_there)]
        sends = [peer.send([t], 0, 20 + i, 0xD2) for i, t in enumerate(back)]
        for w in recvs + sends:
            w.wait(WAIT)

    thread = threading.Thread(target=python_side)
    thread.start()
    stopped = step.run()
    if stopped is not None:  # a loaded host can outlast the slice: the pair finishes
        _finish(stopped[0] + stopped[1])
    thread.join(30)
    assert not thread.is_alive()
    assert all(torch.equal(a, b) for a, b in zip(out, got_there, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(back, got_here, strict=True))


def test_a_send_the_peer_does_not_take_in_time_is_finished_by_the_pair(
    ends: Any, python_end: Any
) -> None:
    pair, far = ends
    data = _bytes(BIG, 6)
    step = _step(pair)
    _send(step, 7, 0, data)
    before = native_steps.STATS["stopped"]
    stopped = step.run()  # nobody reads yet: the socket fills, the slice runs out
    assert stopped is not None and native_steps.STATS["stopped"] == before + 1
    (work,), () = stopped
    assert isinstance(work, SocketWork) and not work.is_completed()
    peer = python_end(far)
    into = torch.zeros_like(data)
    got = peer.recv([into], 0, 7)
    waiter = threading.Thread(target=got.wait, args=(WAIT,))
    waiter.start()
    work.wait(WAIT)
    waiter.join(30)
    assert torch.equal(into, data)


def test_a_half_read_message_is_finished_by_the_pair(ends: Any) -> None:
    pair, far = ends
    data = _bytes(64 << 10, 8)  # half a frame fits the socket buffers: sendall returns
    frame = _frame(3, 0xAB, data.numpy().tobytes())
    far.sendall(frame[: len(frame) // 2])
    into = torch.zeros_like(data)
    step = _step(pair)
    _recv(step, 3, 0xAB, into)
    stopped = step.run()
    assert stopped is not None
    (), (work,) = stopped
    assert isinstance(work, SocketWork) and not work.is_completed()
    far.sendall(frame[len(frame) // 2 :])
    work.wait(WAIT)
    assert torch.equal(into, data)


def test_a_header_cut_short_waits_in_the_pairs_buffer(ends: Any) -> None:
    pair, far = ends
    frame = _frame(4, 0, b"x" * 40)
    far.sendall(frame[:10])
    into = torch.zeros(40, dtype=torch.uint8)
    step = _step(pair)
    _recv(step, 4, 0, into)
    stopped = step.run()
    assert stopped is not None and stopped[1] == [None]  # not begun: post it as usual
    got = pair.recv([into], 0, 4)
    far.sendall(frame[10:])
    got.wait(WAIT)
    assert bytes(into.numpy()) == b"x" * 40


def test_another_frame_stops_the_step_and_reaches_the_python_reader(ends: Any) -> None:
    pair, far = ends
    far.sendall(_frame(9, 0, b"early") + _frame(5, 0, b"wanted"))
    into = torch.zeros(6, dtype=torch.uint8)
    step = _step(pair)
    _recv(step, 5, 0, into)
    stopped = step.run()
    assert stopped is not None and stopped[1] == [None]
    early = torch.zeros(5, dtype=torch.uint8)
    pair.recv([early], 0, 9).wait(WAIT)  # the frame the step met, stashed for its tag
    pair.recv([into], 0, 5).wait(WAIT)
    assert bytes(early.numpy()) == b"early" and bytes(into.numpy()) == b"wanted"


def test_a_hello_of_a_call_that_fell_back_is_skipped_one_of_this_call_stops_the_step(
    ends: Any,
) -> None:
    pair, far = ends
    # A header-only hello (digest FALLBACK, -1) of an earlier call, then the data.
    far.sendall(_frame(7 << 32, -1, b"") + _frame(5, 0, b"wanted"))
    into = torch.zeros(6, dtype=torch.uint8)
    step = _step(pair)
    _recv(step, 5, 0, into)
    assert step.run() is None
    assert bytes(into.numpy()) == b"wanted"
    # Under the tag the step waits on it is this call's: the step stops, and the
    # Python reader meets it (its digest fails the receive there, as refused).
    far.sendall(_frame(5, -1, b""))
    step = _step(pair)
    _recv(step, 5, 0x1234, into)
    stopped = step.run()
    assert stopped is not None and stopped[1] == [None]
    with pytest.raises(DigestMismatch):
        pair.recv([into], 0, 5, 0x1234).wait(WAIT)


def test_a_message_of_another_call_fails_its_receive_as_refused(ends: Any) -> None:
    pair, far = ends
    far.sendall(_frame(5, 0x1111, b"z" * (64 << 10)))
    into = torch.zeros(64 << 10, dtype=torch.uint8)
    step = _step(pair)
    _recv(step, 5, 0x2222, into)
    stopped = step.run()
    assert stopped is not None and stopped[1] == [None]
    with pytest.raises(DigestMismatch):
        pair.recv([into], 0, 5, 0x2222).wait(WAIT)
    assert pair.error is None  # refused, not broken
    assert not into.any()  # nothing of the refused message landed in the buffer


def test_a_closed_peer_stops_the_step_and_the_pair_fails(ends: Any) -> None:
    pair, far = ends
    far.close()
    into = torch.zeros(16, dtype=torch.uint8)
    step = _step(pair)
    _recv(step, 1, 0, into)
    began = time.monotonic()
    stopped = step.run()
    assert stopped is not None and time.monotonic() - began < native_steps.SLICE_S * 4
    with pytest.raises(PairError):
        pair.recv([into], 0, 1).wait(WAIT)


def test_a_given_up_epoch_keeps_the_step_out(ends: Any) -> None:
    pair, _far = ends
    ledger = OpLedger()
    ledger.freeze()  # the epoch was given up: no op of it is waited for
    step = native_steps.Step([pair], [ledger])
    _recv(step, 1, 0, torch.zeros(4, dtype=torch.uint8))
    assert step.run() == ([], [None])
    assert ledger.blocked() == 0


def _allreduce_many(pg: Any, rank: int, world: int, slice_s: float = -1.0) -> tuple[str, int, int]:
    stop_c_steps_early(rank, slice_s)
    digest = hashlib.sha256()
    before = dict(native_steps.STATS)
    for i, numel in enumerate([1 << 20, 3 << 16, 12345, 1 << 20]):
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            t = (torch.arange(numel, dtype=torch.float64) * (rank + 1) + i).to(dtype)
            pg.allreduce([t]).wait()
            expect = (torch.arange(numel, dtype=torch.float64) * 10 + 4 * i).to(dtype)
            if dtype is torch.int64:
                assert torch.equal(t, expect)
            digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return (
        digest.hexdigest(),
        native_steps.STATS["steps"] - before["steps"],
        native_steps.STATS["stopped"] - before["stopped"],
    )


@pytest.mark.timeout(360)
@pytest.mark.parametrize(
    ("topology", "rails"), [("auto", 1), ("ring", 1), ("auto", 2), ("ring", 2)]
)
def test_all_reduce_is_bitwise_the_same_with_c_steps_without_and_handed_back(
    topology: str, rails: int
) -> None:
    # On two rails each rail's steps run at once, and carry the acknowledgements a
    # failover needs (resilient.collectives.native_acks): handed back part-way too.
    config: dict[str, Any] = {"topology": topology}
    on = run_world(_allreduce_many, 4, rails=rails, config=config)
    off = run_world(_allreduce_many, 4, rails=rails, config={**config, "native_io": False})
    # Steps with no time to wait: nearly every one stops part-way, at whatever byte
    # each stream had reached, and the channels finish the call.
    stopping = run_world(_allreduce_many, 4, rails=rails, args=(0.002,), config=config)
    # Every rank, all three ways: the same bits.
    assert len({d for d, _, _ in on + off + stopping}) == 1
    assert all(steps > 0 for _, steps, _ in on)
    assert all(steps == 0 for _, steps, _ in off)
    assert sum(stopped for _, _, stopped in stopping) > 0


def _passes_since(before: dict[str, int]) -> tuple[int, int, int]:
    """Rail passes in C, in Python, and C steps stopped, since ``before`` (STATS)."""
    now = native_steps.STATS
    return (
        now["c_passes"] - before["c_passes"],
        now["python_passes"] - before["python_passes"],
        now["stopped"] - before["stopped"],
    )


def _gather_and_scatter(
    pg: Any, rank: int, world: int, slice_s: float = -1.0
) -> tuple[bool, int, int, int]:
    """FSDP2's two collectives (all_gather_into_tensor, reduce_scatter_tensor)
    against results computed here; how many rail passes went in C and in Python."""
    stop_c_steps_early(rank, slice_s)
    before = dict(native_steps.STATS)
    ok = True
    for numel in (1 << 18, 12345, 1 << 20):
        mine = torch.arange(numel, dtype=torch.float32) + rank * numel
        out = torch.empty(numel * world)
        pg._allgather_base(out, mine).wait()
        ok = ok and torch.equal(out, torch.arange(numel * world, dtype=torch.float32))
        # Small integers: their float sums are exact in any order.
        full = (torch.arange(numel * world) % 1024).float() * (rank + 1)
        part = torch.empty(numel)
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        pg._reduce_scatter_base(part, full, opts).wait()
        want = (torch.arange(rank * numel, (rank + 1) * numel) % 1024).float() * 10
        ok = ok and torch.equal(part, want)
    return (ok, *_passes_since(before))


@pytest.mark.timeout(240)
def test_fsdp_collectives_run_in_c_steps_on_two_rails_and_finish_when_handed_back() -> None:
    on = run_world(_gather_and_scatter, 4, rails=2)
    stopping = run_world(_gather_and_scatter, 4, rails=2, args=(0.002,))
    assert all(ok for ok, *_ in on + stopping)
    # Healthy and quiet: the rail passes go in C (the mesh's all_gather is its second
    # step). Not every one: on a loaded host loopback drops packets now and then, the
    # peer watch cuts a link that shows retransmission timeouts, and that call's
    # passes finish on the Python path (seen once in a few runs beside a 4-rank job).
    assert all(c > 0 for _, c, _, _ in on), on
    assert sum(py for _, _, py, _ in on) * 4 <= sum(c for _, c, _, _ in on), on
    assert sum(stopped for *_, stopped in stopping) > 0


def _broadcast_many(
    pg: Any, rank: int, world: int, slice_s: float = -1.0
) -> tuple[bool, int, int, int]:
    """Broadcasts from every root, checked here; rail passes in C and in Python."""
    stop_c_steps_early(rank, slice_s)
    before = dict(native_steps.STATS)
    ok = True
    for root in range(world):
        for numel in (1 << 20, 777):
            want = torch.randn(numel, generator=torch.Generator().manual_seed(root + numel))
            t = want.clone() if rank == root else torch.zeros(numel)
            opts = dist.BroadcastOptions()
            opts.rootRank = root
            pg.broadcast([t], opts).wait()
            ok = ok and torch.equal(t, want)
    return (ok, *_passes_since(before))


@pytest.mark.timeout(240)
def test_a_broadcast_chain_runs_in_c_steps_and_finishes_when_handed_back() -> None:
    on = run_world(_broadcast_many, 4, rails=2)
    off = run_world(_broadcast_many, 4, rails=2, config={"native_io": False})
    stopping = run_world(_broadcast_many, 4, rails=2, args=(0.002,))
    assert all(ok for ok, *_ in on + off + stopping)
    assert all(c > 0 for _, c, _, _ in on), on
    assert sum(py for _, _, py, _ in on) * 4 <= sum(c for _, c, _, _ in on), on
    assert all(c == 0 for _, c, _, _ in off), off
    assert sum(stopped for *_, stopped in stopping) > 0


def _cut_mid_step(pg: Any, rank: int, world: int, n: int) -> dict[str, Any]:
    x = torch.randn(n, generator=torch.Generator().manual_seed(7 + rank))
    want = x.clone()
    pg.allreduce([want]).wait()  # the fault-free result
    fired = threading.Event()
    if rank == 1:
        real = native_steps._stepio

        class _Cutting:
            """The first C step of the call starts a timer that cuts rail 0 (a NIC
            going down) while the rails' steps move the call's bytes."""

            @staticmethod
            def exchange(*args: Any) -> Any:
                if not fired.is_set():
                    fired.set()
                    threading.Timer(0.003, pg.board.nic_changed, args=(0, False)).start()
                return real.exchange(*args)

        native_steps._stepio = _Cutting()
    before = native_steps.STATS["stopped"]
    got = x.clone()
    pg.allreduce([got]).wait()
    stopped = native_steps.STATS["stopped"] - before
    again = x.clone()
    for _ in range(3):  # the group goes on; the dead rail gets no share any more
        again.copy_(x)
        pg.allreduce([again]).wait()
    return {
        "equal": torch.equal(got, want),
        "again_equal": torch.equal(again, want),
        "fired": fired.is_set(),
        "stopped": stopped,
        "failovers": list(pg.engine.failovers),
        "weights": pg.engine.weights,
    }


@pytest.mark.timeout(240)
@pytest.mark.parametrize("topology", ["ring", "mesh"])
def test_a_rail_lost_mid_step_hands_back_and_fails_over_bit_for_bit(topology: str) -> None:
    out = run_world(
        _cut_mid_step,
        4,
        rails=2,
        args=(1 << 23,),  # 32 MB: its C steps take tens of milliseconds
        config={"topology": topology, "single_rail_below_bytes": 0},
    )
    assert out[1]["fired"]
    # The cut stopped the victim's steps part-way; its channels finished the call
    # on rail 1, with the bits of the fault-free call, on every rank.
    assert out[1]["stopped"] > 0
    for rank, res in enumerate(out):
        assert res["equal"], rank
        assert res["again_equal"], rank
    moved = [m for res in out for m in res["failovers"]]
    assert moved and all(src == 0 and dst == 1 for _, src, dst, _ in moved), moved
    assert all(res["weights"][0] == 0 for res in out)


def test_failing_a_pair_ends_a_step_that_holds_its_engine(
    ends: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    pair, _far = ends
    monkeypatch.setattr(native_steps, "SLICE_S", 20.0)  # only the stop pipe can end it early
    step = _step(pair)
    _recv(step, 1, 0, torch.zeros(16, dtype=torch.uint8))
    failer = threading.Timer(0.2, pair.fail, args=("the link above broke",))
    began = time.monotonic()
    failer.start()
    stopped = step.run()
    took = time.monotonic() - began
    failer.join(10)
    assert stopped is not None and stopped[1] == [None]
    assert took < 5.0  # not the slice: the failing thread stopped the step
    assert pair.error == "the link above broke"


@pytest.mark.parametrize("dtype", list(native_steps.FOLDS))
def test_a_folded_receive_adds_into_its_target_as_torch_does(ends: Any, dtype: Any) -> None:
    pair, far = ends
    g = torch.Generator().manual_seed(9)
    if dtype.is_floating_point:
        into, part = (torch.randn(3000, generator=g, dtype=dtype) * 1e3 for _ in range(2))
    else:  # near the type's edges, so that the sum wraps as torch's does
        info = torch.iinfo(dtype)
        into, part = (
            torch.randint(info.max // 2, info.max, (3000,), generator=g, dtype=dtype)
            for _ in range(2)
        )
    expect = into.clone().add_(part)
    far.sendall(_frame(6, 0, part.numpy().tobytes()))
    scratch = torch.zeros_like(part)
    step = _step(pair)
    nbytes = scratch.numel() * scratch.element_size()
    raw = memoryview(scratch.numpy()).cast("B")
    step.recv(
        0,
        6,
        0,
        raw,
        scratch.data_ptr(),
        0,
        nbytes,
        fold=into.data_ptr(),
        kind=native_steps.FOLDS[dtype],
    )
    assert step.run() is None
    assert torch.equal(scratch, part) and torch.equal(into, expect)  # bit for bit


def test_a_send_waits_for_the_receive_it_follows(
    ends: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    pair, far = ends
    monkeypatch.setattr(native_steps, "SLICE_S", 20.0)  # the step outlasts the wait below
    far.settimeout(0.2)
    got = torch.zeros(64, dtype=torch.uint8)
    out = _bytes(64, 11)
    step = _step(pair)
    first = step.recv(0, 1, 0, memoryview(got.numpy()), got.data_ptr(), 0, 64)
    step.send(0, 2, 0, memoryview(out.numpy()), out.data_ptr(), 0, 64, after_recv=first)
    result: list[Any] = []
    runner = threading.Thread(target=lambda: result.append(step.run()))
    runner.start()
    with pytest.raises(TimeoutError):
        far.recv(1)  # nothing leaves before the receive it waits for is whole
    far.sendall(_frame(1, 0, bytes(range(64))))
    far.settimeout(10)
    answer = b""
    while len(answer) < _HEADER.size + 64:
        answer += far.recv(1 << 16)
    runner.join(10)
    assert result == [None]
    assert answer == _frame(2, 0, out.numpy().tobytes())
    assert bytes(got.numpy()) == bytes(range(64))

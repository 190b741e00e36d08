"""Pure schedule math for ring collectives over several rails (no torch, no I/O).

The tensor (flattened) is first cut into ``P`` *global chunks*, one per ring
position, and only then each chunk is cut across rails by the rail weights. An
element's global chunk therefore depends only on ``numel`` and ``P``, never on the
weights, and the ring reduces every element in the same rank order whichever rail
carries it: moving bytes between rails never changes the result bits.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

__all__ = [
    "RingPass",
    "RingSeat",
    "Span",
    "avoiding_ring",
    "even_bounds",
    "rail_pieces",
    "rail_sizes",
    "recv_chunk",
    "send_chunk",
    "skip_bounds",
    "sub_count",
    "sub_spans",
]


@dataclass(frozen=True, slots=True)
class Span:
    """A half-open element range ``[start, stop)`` of the flat buffer."""

    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def even_bounds(n: int, parts: int) -> list[Span]:
    """Cut ``n`` elements into ``parts`` contiguous spans; the first ``n % parts`` get one more."""
    if parts < 1:
        raise ValueError(f"parts={parts}: must be >= 1")
    base, extra = divmod(n, parts)
    out: list[Span] = []
    start = 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append(Span(start, stop))
        start = stop
    return out


def skip_bounds(n: int, parts: int, skip: int) -> list[Span]:
    """Like :func:`even_bounds`, but part ``skip`` is empty and the others share ``n``."""
    if not 0 <= skip < parts or parts < 2:
        raise ValueError(f"skip={skip}: need 0 <= skip < parts and parts >= 2 (parts={parts})")
    shared = even_bounds(n, parts - 1)
    out = shared[:skip]
    at = shared[skip - 1].stop if skip else 0
    out.append(Span(at, at))
    return out + shared[skip:]


def rail_sizes(n: int, weights: Sequence[float], align: int = 1) -> list[int]:
    """Split ``n`` elements across rails in proportion to ``weights``.

    Sizes are multiples of ``align`` except the last non-empty one, which takes the
    remainder. Deterministic: every rank computes the same split from the same weights.

    Raises:
        ValueError: no weights, a negative weight, or all weights zero.
    """
    if not weights:
        raise ValueError("rail weights: at least one rail is required")
    if any(w < 0 for w in weights):
        raise ValueError(f"rail weights {list(weights)}: must be >= 0")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError(f"rail weights {list(weights)}: at least one must be > 0")
    sizes: list[int] = []
    left = n
    for i, w in enumerate(weights):
        if i == len(weights) - 1 or left == 0:
            size = left if i == len(weights) - 1 else 0
        else:
            size = min(left, round(n * w / total / align) * align)
        sizes.append(size)
        left -= size
    return sizes


def rail_pieces(
    chunks: Sequence[Span], weights: Sequence[float], align: int = 1
) -> list[list[Span]]:
    """``pieces[rail][chunk]``: each global chunk cut across rails by ``weights``."""
    pieces: list[list[Span]] = [[] for _ in weights]
    for chunk in chunks:
        start = chunk.start
        for rail, size in enumerate(rail_sizes(chunk.size, weights, align)):
            pieces[rail].append(Span(start, start + size))
            start += size
    return pieces


def sub_count(pieces: Sequence[Span], elem: int, grain: int, most: int) -> int:
    """Sub-chunks per piece: ``grain`` bytes each for the largest piece, at most
    ``most`` (at least one)."""
    largest = max((p.size for p in pieces), default=0) * elem
    return max(1, min(most, round(largest / grain)))


def sub_spans(span: Span, count: int) -> list[Span]:
    """Cut ``span`` into ``count`` pipelining sub-spans (some may be empty)."""
    return [Span(span.start + s.start, span.start + s.stop) for s in even_bounds(span.size, count)]


def send_chunk(rank: int, step: int, world: int, shift: int = 0) -> int:
    """Chunk that ``rank`` sends to its right neighbour at ring ``step``.

    With ``shift=0`` rank r starts by sending its own chunk r (all-gather), and an
    all-reduce leaves it owning the reduced chunk r+1 after the reduce-scatter half,
    which the all-gather half then sends first; ``shift=-1`` makes a P-1 step
    reduce-scatter end with rank r owning chunk r. The chunk received at step t is
    the one sent at step t+1.
    """
    return (rank - step + shift) % world


def recv_chunk(rank: int, step: int, world: int, shift: int = 0) -> int:
    """Chunk that ``rank`` receives from its left neighbour at ring ``step``."""
    return (rank - step - 1 + shift) % world


@dataclass(slots=True)
class RingPass:
    """What one rail does in one ring pass."""

    rail: int
    pieces: list[Span]  # per global chunk, this rail's part
    steps: int  # total ring steps
    reduce_steps: int  # the first steps receive into scratch and reduce
    shift: int  # see send_chunk
    subs: int  # sub-chunks per piece


class RingSeat(Protocol):
    """Where this rank sits in the ring order: what a ring pass asks of its
    engine (:class:`~resilient.collectives.engine.RingEngine` is one)."""

    @property
    def world(self) -> int: ...

    @property
    def pos(self) -> int:
        """This rank's position in the ring order."""
        ...

    @property
    def left(self) -> int: ...

    @property
    def right(self) -> int: ...

    def rank_at(self, pos: int) -> int:
        """The rank at ring position ``pos`` (also the chunk that position owns)."""
        ...


# Search budget of :func:`avoiding_ring` (vertices tried): with a few cut pairs the
# first path found almost always closes; many cuts may leave no ring at all.
_RING_SEARCH_LIMIT: Final = 20_000


def avoiding_ring(world: int, cut: Collection[tuple[int, int]]) -> tuple[int, ...] | None:
    """A ring order of ``world`` ranks in which no two neighbours are a ``cut`` pair.

    Deterministic (every rank computes the same order from the same pairs): a depth
    first search from rank 0 that tries the lowest rank first, so it stays as close
    to ``0, 1, ..., world-1`` as the cuts allow. None when nothing is cut (the
    natural order), or when no such ring exists or was found within the search
    budget (three ranks with one cut pair have none).
    """
    pairs = {(min(a, b), max(a, b)) for a, b in cut if a != b and 0 <= a < world and 0 <= b < world}
    if not pairs or world < 4:
        return None

    def ok(a: int, b: int) -> bool:
        return (min(a, b), max(a, b)) not in pairs

    path, used, budget = [0], [False] * world, _RING_SEARCH_LIMIT
    used[0] = True
    stack = [iter(range(1, world))]
    while stack and budget > 0:
        nxt = next((v for v in stack[-1] if not used[v] and ok(path[-1], v)), None)
        if nxt is None:
            stack.pop()
            used[path.pop()] = False
            continue
        budget -= 1
        path.append(nxt)
        used[nxt] = True
        if len(path) == world:
            if ok(nxt, 0):
                return tuple(path)
            used[path.pop()] = False
            continue
        stack.append(iter(range(1, world)))
    return None

"""Child-process body for the gloo-over-EtcdStore tests (imported by 'spawn' children).

Kept apart from the test module so a child imports only what it needs.
"""

from __future__ import annotations

import gc
import json
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from membership.store import EtcdStore
from resilient.config import EtcdConfig

GLOO_TIMEOUT = timedelta(seconds=60)


def _all_reduce_once(store: EtcdStore, pg_prefix: str, rank: int, world: int) -> list[float]:
    """Build a gloo group through ``PrefixStore(pg_prefix, store)``, all_reduce, delete it."""
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = GLOO_TIMEOUT
    pg = dist.ProcessGroupGloo(dist.PrefixStore(pg_prefix, store), rank, world, opts)
    try:
        tensor = torch.full((8,), float(rank + 1))
        pg.allreduce([tensor]).wait()
        return tensor.tolist()
    finally:
        del pg  # delete the group before the process exits (rare abort on exit otherwise)
        gc.collect()


def run_rank(
    config: EtcdConfig,
    store_prefix: str,
    rank: int,
    world: int,
    pg_prefixes: list[str],
    out_dir: str,
) -> None:
    """Run one all_reduce per group prefix; write the results to ``out_dir/rank<N>.json``.

    Raises whatever failed (the child then exits non-zero) after writing the traceback.
    """
    out = Path(out_dir) / f"rank{rank}.json"
    store = EtcdStore(config, store_prefix, timeout=GLOO_TIMEOUT)
    try:
        results = {p: _all_reduce_once(store, p, rank, world) for p in pg_prefixes}
        out.write_text(json.dumps({"ok": True, "results": results}))
    except BaseException:
        out.write_text(json.dumps({"ok": False, "error": traceback.format_exc()}))
        raise
    finally:
        store.close()

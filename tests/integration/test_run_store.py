"""A job that needs no TCPStore: under a run id (RESILIENT_RUN_ID) ranks meet in etcd.

``resilient run`` gives every rank RESILIENT_RUN_ID. ``resilient.init()`` then makes
torch's init store the run's etcd store, and the backend's own rendezvous (links,
subgroup rosters) never reads the store torch hands it. Here MASTER_ADDR:MASTER_PORT
points at a port nobody listens on: a rank that tried a TCPStore would fail there.
"""

from __future__ import annotations

import os
import traceback
import uuid
from datetime import timedelta
from typing import Any

import pytest

from membership.etcd_client import EtcdClient
from resilient.backend import _link_store
from resilient.config import EtcdConfig, RankEnv
from resilient.errors import ConfigError
from resilient.procs import free_port
from tests._dist import _spawn

WORLD = 4


def _entry(rank: int, port: int, results: Any, env: dict[str, str]) -> None:
    try:
        os.environ.update(env)
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RESILIENT_RAILS=f"127.0.1.{rank + 1}",
        )  # fmt: skip
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        import resilient

        torch.set_num_threads(1)
        resilient.init(timeout=timedelta(seconds=60))
        try:
            default = dist.distributed_c10d._get_default_store()
            while hasattr(default, "underlying_store"):  # torch's PrefixStores
                default = default.underlying_store
            out: dict[str, Any] = {"init_store": type(default).__name__}
            t = torch.arange(4, dtype=torch.float32) + rank
            dist.all_reduce(t)
            out["sum"] = t.tolist()
            pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
            p = torch.tensor([rank + 1.0])
            dist.all_reduce(p, group=pair)
            out["pair"] = p.item()
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
            g = torch.empty(2, dtype=torch.int64)
            dist.all_gather_into_tensor(g, torch.tensor([rank]), group=mesh.get_group("shard"))
            out["shard"] = g.tolist()
            objs: list[Any] = [None] * WORLD
            dist.all_gather_object(objs, {"r": rank})
            out["objs"] = objs
            dist.barrier()
        finally:
            dist.destroy_process_group()
        results.put((rank, "ok", out))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


@pytest.mark.timeout(180)
def test_ranks_start_and_make_subgroups_with_no_tcpstore_anywhere(
    etcd_config: EtcdConfig,
) -> None:
    job, run = f"test-{uuid.uuid4().hex[:12]}", uuid.uuid4().hex[:16]
    env = {
        "RESILIENT_ETCD": ",".join(etcd_config.endpoints),
        "RESILIENT_TOKEN": "run-store-secret",
        "RESILIENT_JOB": job,
        "RESILIENT_RUN_ID": run,
    }
    nobody = free_port()  # nothing listens there: a TCPStore client would time out
    results, _ = _spawn(_entry, WORLD, 150, frozenset(), lambda r, port, q: (r, nobody, q, env))
    for rank, r in enumerate(results):
        assert r["init_store"] == "EtcdStore", rank
        assert r["sum"] == [float(6 + 4 * i) for i in range(4)], rank
        assert r["pair"] == (3.0 if rank < 2 else 7.0), rank
        base = 2 * (rank // 2)
        assert r["shard"] == [base, base + 1], rank
        assert r["objs"] == [{"r": i} for i in range(WORLD)], rank
    client = EtcdClient(etcd_config)
    try:
        rows, _ = client.get_prefix(f"/resilient/{job}/store/")
    finally:
        client.close()
    keys = [kv.key for kv in rows]
    run_prefix = f"/resilient/{job}/store/run-{run}/"
    # Every rendezvous key is this run's: the world's links (g0) and the subgroups'
    # links and rosters; none went through a nonce from an init store.
    assert keys and all(k.startswith(run_prefix) for k in keys), keys[:5]
    parts = {k[len(run_prefix) :].split("/", 1)[0] for k in keys}
    assert "g0" in parts and len(parts) >= 4, parts
    assert any("resilient/roster/" in k for k in keys), keys[:5]


class _NoStore:
    """An init store that must not be used."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the init store was used: {name}")


def test_under_a_run_id_the_link_store_never_reads_the_init_store() -> None:
    env = RankEnv(
        rank=0, world_size=2, job="j1", run_id="r1",
        etcd=EtcdConfig(endpoints=("http://127.0.0.1:1",)),
    )  # fmt: skip
    store = _link_store(env, _NoStore(), "3")  # type: ignore[arg-type]
    assert type(store).__name__ == "EtcdStore"
    assert store.prefix == "/resilient/j1/store/run-r1/g3/"  # type: ignore[attr-defined]


def test_a_malformed_run_id_is_refused_with_its_variable_named() -> None:
    with pytest.raises(ConfigError, match="RESILIENT_RUN_ID"):
        RankEnv.from_env({"RANK": "0", "WORLD_SIZE": "1", "RESILIENT_RUN_ID": "a/b"})

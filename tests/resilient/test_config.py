"""Config dataclasses and env parsing: clear errors naming the variable."""

from __future__ import annotations

import pytest

from resilient.config import DataPlaneConfig, EtcdConfig, RankEnv, parse_endpoints
from resilient.errors import ConfigError
from resilient.links.rails import resolve_rails


@pytest.mark.timeout(10)
def test_rank_env_reads_everything() -> None:
    env = {
        "RANK": "2",
        "WORLD_SIZE": "4",
        "RESILIENT_ETCD": "127.0.0.1:2379,https://h:1",
        "RESILIENT_JOB": "j1",
        "RESILIENT_TOKEN": "t",
        "RESILIENT_RAILS": "127.0.1.3, 127.0.2.3",
        "RESILIENT_INCARNATION": "3",
        "RESILIENT_LEASE_TTL_S": "7.5",
    }
    got = RankEnv.from_env(env)
    assert (got.rank, got.world_size, got.incarnation, got.lease_ttl_s) == (2, 4, 3, 7.5)
    assert got.rails == ("127.0.1.3", "127.0.2.3")
    assert got.etcd is not None
    assert got.etcd.endpoints == ("http://127.0.0.1:2379", "https://h:1")
    assert RankEnv.from_env(env, rank=0, world_size=1).rank == 0


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "env,needle",
    [
        ({"WORLD_SIZE": "2"}, "RANK"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK"),
        ({"RANK": "0", "WORLD_SIZE": "1", "RESILIENT_INCARNATION": "-1"}, "INCARNATION"),
        ({"RANK": "0", "WORLD_SIZE": "1", "RESILIENT_JOB": "a/b"}, "job name"),
        ({"RANK": "0", "WORLD_SIZE": "1", "RESILIENT_ETCD": "h:notaport"}, "port"),
        ({"RANK": "0", "WORLD_SIZE": "1", "RESILIENT_FAULT_CONTROL": "maybe"}, "FAULT_CONTROL"),
    ],
)
def test_rank_env_errors_name_the_variable(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        RankEnv.from_env(env)


@pytest.mark.timeout(10)
def test_data_plane_env() -> None:
    cfg = DataPlaneConfig.from_env(
        {
            "RESILIENT_RAIL_WEIGHTS": "3,1",
            "RESILIENT_SUB_CHUNK_BYTES": "65536",
            "RESILIENT_CHECK_MISMATCH": "0",
            "RESILIENT_STRAGGLER_SCHEDULE": "0",
            "RESILIENT_RELAY_VIA_STORE": "no",
            "RESILIENT_REPAIR_TIMEOUT_S": "2.5",
            "RESILIENT_ELIDE_EVERY": "0",
        }
    )
    assert cfg.rail_weights == (3.0, 1.0) and cfg.sub_chunk_bytes == 65536
    assert not cfg.check_mismatch
    assert not cfg.straggler_schedule and not cfg.relay_via_store
    assert cfg.repair_timeout_s == 2.5 and cfg.elide_every == 0
    default = DataPlaneConfig.from_env({})
    assert default.straggler_schedule and default.relay_via_store and default.repair_links
    assert default.elide_every == DataPlaneConfig().elide_every == 8
    assert cfg.deadline_s(0) == cfg.op_timeout_floor_s
    for bad in (
        {"RESILIENT_RAIL_WEIGHTS": "a,b"},
        {"RESILIENT_RAIL_WEIGHTS": "0,0"},
        {"RESILIENT_SUB_CHUNK_BYTES": "10"},
        {"RESILIENT_CHECK_MISMATCH": "maybe"},
        {"RESILIENT_RELAY_VIA_STORE": "2"},
        {"RESILIENT_ELIDE_EVERY": "-1"},
        {"RESILIENT_ELIDE_EVERY": "often"},
    ):
        with pytest.raises(ConfigError):
            DataPlaneConfig.from_env(bad)


@pytest.mark.timeout(10)
def test_etcd_config_validation(tmp_path: object) -> None:
    with pytest.raises(ConfigError, match="together"):
        EtcdConfig(endpoints=("h:1",), user="u")
    with pytest.raises(ConfigError, match="does not exist"):
        EtcdConfig(endpoints=("h:1",), ca_cert="/nonexistent/ca.pem")
    with pytest.raises(ConfigError):
        parse_endpoints("ftp://h:1")
    with pytest.raises(ConfigError):
        parse_endpoints(" , ")


@pytest.mark.timeout(10)
def test_rails_from_addresses_or_interface_names() -> None:
    assert resolve_rails(["127.0.1.1", "lo"]) == ("127.0.1.1", "127.0.0.1")
    assert resolve_rails([], "127.0.0.1") == ("127.0.0.1",)
    with pytest.raises(ConfigError, match="no such network interface"):
        resolve_rails(["nonexistent-nic0"])

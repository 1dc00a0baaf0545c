"""`--dp-size`: each replica's options and GPUs (pure functions of dp_launch)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lmserver.edge.cli import parse_config
from lmserver.edge.dp_launch import replica_args, replica_env, replica_gpus, visible_cuda_devices


def test_replica_args_reproduce_the_config_with_dp_1_and_own_port() -> None:
    config = parse_config(["--dp-size", "2", "--port", "9000", "--tp-size", "2", "--max-running-requests", "64",
                           "--disable-radix-cache", "--router-policy", "round_robin"])
    for i in range(2):
        replica = parse_config(replica_args(config, i))
        assert replica == config.replace(dp_size=1, port=9001 + i)


def test_two_replicas_on_two_gpus_get_one_each() -> None:
    assert [replica_gpus(i, 1, ["0", "1"]) for i in range(2)] == [["0"], ["1"]]
    assert [replica_gpus(i, 2, ["4", "5", "6", "7"]) for i in range(2)] == [["4", "5"], ["6", "7"]]


@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 8))
def test_gpu_groups_are_disjoint_when_enough_and_always_from_the_visible_list(dp: int, tp: int, n: int) -> None:
    visible = [str(10 + k) for k in range(n)]
    groups = [replica_gpus(i, tp, visible) for i in range(dp)]
    assert all(len(g) == tp and set(g) <= set(visible) for g in groups)
    flat = [d for g in groups for d in g]
    if dp * tp <= n:
        assert len(set(flat)) == dp * tp  # no GPU shared
    else:
        assert sorted(set(flat)) == sorted(visible)  # wrapped around: every GPU used


def test_replica_env_narrows_cuda_devices_only_on_gpus() -> None:
    base = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "2,3"}
    gpu = parse_config(["--dp-size", "2", "--device", "cuda"])
    env = replica_env(gpu, 1, base, visible_cuda_devices(base))
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and env["PATH"] == "/bin"
    cpu = parse_config(["--dp-size", "2", "--device", "cpu"])
    assert replica_env(cpu, 1, base, ["2", "3"]) == base
    assert replica_env(gpu, 0, {"PATH": "/bin"}, []) == {"PATH": "/bin"}  # no GPU visible: unchanged


def test_visible_devices_follow_the_variable() -> None:
    assert visible_cuda_devices({"CUDA_VISIBLE_DEVICES": "1, 0"}) == ["1", "0"]
    assert visible_cuda_devices({"CUDA_VISIBLE_DEVICES": ""}) == []


def test_the_api_key_reaches_replicas_through_the_environment_only() -> None:
    from lmserver.config import API_KEY_ENV

    config = parse_config(["--dp-size", "2", "--api-key", "sk-secret-42"])
    for i in range(2):
        args = replica_args(config, i)
        assert "sk-secret-42" not in " ".join(args) and "--api-key" not in args
        env = replica_env(config, i, {"PATH": "/bin", API_KEY_ENV: "stale"}, [])
        assert env[API_KEY_ENV] == "sk-secret-42"
        assert parse_config(args, env) == config.replace(dp_size=1, port=config.port + 1 + i)
    keyless = parse_config(["--dp-size", "2"])
    assert API_KEY_ENV not in replica_env(keyless, 0, {API_KEY_ENV: "stale"}, [])
    # the variable serves `lmserver serve` too; --api-key wins over it
    assert parse_config([], {API_KEY_ENV: "from-env"}).api_key == "from-env"
    assert parse_config(["--api-key", "flag"], {API_KEY_ENV: "from-env"}).api_key == "flag"
    assert parse_config([], {API_KEY_ENV: ""}).api_key is None

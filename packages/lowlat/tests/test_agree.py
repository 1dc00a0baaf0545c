"""TP agreement: MIN all-reduce of verdicts + all-gather of coverage, on a fake group and on gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lowlat import (
    Coverage,
    LayerShape,
    LowlatConfig,
    Registry,
    Requirements,
    Session,
    Step,
    StepKind,
    Unsupported,
    agree,
)
from lowlat.build import BuildContext, Built
from lowlat.testing import EchoBuilt, FakeGroup, FakeWorld, fake_setup, fake_spec

SHAPE = LayerShape(hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=16)


def test_single_rank_needs_no_group() -> None:
    cov = Coverage(max_tokens=8)
    a = agree("p", "1", cov, None)
    assert a.enabled and a.coverage == cov and a.world_size == 1
    assert not agree(None, None, None, None).enabled


def test_fake_group_all_agree_intersects_coverage() -> None:
    world = FakeWorld(3)
    covs = [
        Coverage(frozenset({StepKind.DECODE, StepKind.VERIFY}), 16, 4, None),
        Coverage(frozenset({StepKind.DECODE}), 8, 1, 4096),
        Coverage(frozenset({StepKind.DECODE, StepKind.VERIFY}), 32, 2, 2048),
    ]
    out = world.run(lambda g: agree("nv", "1", covs[g.rank], g))
    assert all(a == out[0] for a in out)
    assert out[0].enabled and out[0].coverage == Coverage(frozenset({StepKind.DECODE}), 8, 1, 2048)
    assert world.calls == ["all_reduce_min", "all_gather_object"]


def test_fake_group_one_rank_off_turns_everyone_off() -> None:
    world = FakeWorld(2)
    out = world.run(lambda g: agree("nv" if g.rank == 0 else None, "1", Coverage() if g.rank == 0 else None, g))
    assert [a.enabled for a in out] == [False, False]
    assert "ranks [1]" in out[0].reasons[0]


def test_fake_group_different_plugins_turn_everyone_off() -> None:
    world = FakeWorld(2)
    out = world.run(lambda g: agree("nv" if g.rank == 0 else "amd", "1", Coverage(), g))
    assert not out[0].enabled and not out[1].enabled
    assert "different plugins" in out[1].reasons[0]


def _session_on_rank(group: FakeGroup) -> tuple[str, str]:
    # rank 1 runs with a forbidden feature, so the plugin is Unsupported there
    req = Requirements(forbidden_features=frozenset({"lora"}))
    s = Session(LowlatConfig(), Registry([fake_spec(requirements=req)]))
    s.configure(fake_setup(features=frozenset({"lora"}) if group.rank == 1 else frozenset()))
    s.loaded()
    s.check_model(None)
    s.agree(group)
    s.build(SHAPE, [], "cpu", torch.float32)
    s.memory_measured()
    s.kv_sized(64)
    s.install()
    return s.select(Step.decode(1)), s.explain()


def test_sessions_agree_through_fake_group() -> None:
    out = FakeWorld(2).run(_session_on_rank)
    assert [p for p, _ in out] == ["original", "original"]
    assert "ranks [1] cannot run a plugin" in out[0][1]


def _require_session(group: FakeGroup, refuse_on: int) -> str:
    """A require-mode start-up of a TP=2 session whose plugin's check fails on rank ``refuse_on``."""

    def check(model: object) -> tuple[str, ...]:
        return ("shard too small",) if group.rank == refuse_on else ()

    s = Session(LowlatConfig(mode="require", plugins=("fake",)), Registry([fake_spec(check_model=check)]))
    s.configure(fake_setup(tp_size=2))
    s.loaded()
    s.check_model(None)  # rank 1 has no plugin left: deferred, not raised (rank 0 is on its way to agree)
    try:
        s.agree(group)
    except Unsupported as exc:
        return str(exc)
    return "started"


def test_require_mode_check_failing_on_one_rank_fails_every_rank_with_its_reason() -> None:
    out = FakeWorld(2).run(lambda g: _require_session(g, refuse_on=1))
    assert out[0] == out[1]
    assert "ranks [1] cannot run a plugin" in out[0] and "rank 1: fake: shard too small" in out[0]
    assert FakeWorld(2).run(lambda g: _require_session(g, refuse_on=-1)) == ["started", "started"]


def test_require_mode_tp_size_excluded_on_every_rank_raises_at_agree() -> None:
    def body(group: FakeGroup) -> tuple[bool, str]:
        s = Session(LowlatConfig(mode="require", plugins=("fake",)), Registry([fake_spec(requirements=Requirements(tp_sizes=(1,)))]))
        s.configure(fake_setup(tp_size=2))
        deferred = s.deferred is not None
        s.loaded()
        s.check_model(None)
        with pytest.raises(Unsupported) as info:
            s.agree(group)
        return deferred, str(info.value)

    out = FakeWorld(2).run(body)
    assert out[0] == out[1] and out[0][0]
    assert "needs TP size in [1], server uses 2" in out[0][1] and "ranks [0, 1]" in out[0][1]
    with pytest.raises(Unsupported, match="needs TP size"):  # one rank: raised at configure, as before
        Session(LowlatConfig(mode="require"), Registry([fake_spec(requirements=Requirements(tp_sizes=(2,)))])).configure(
            fake_setup()
        )


def _build_session(group: FakeGroup, mode: str, fail_on: int) -> tuple[str, int, str]:
    def build(ctx: BuildContext) -> Built:
        if ctx.tp_rank == fail_on:
            raise Unsupported("fake", ("no workspace for this shard",))
        return EchoBuilt("fake", 64, workspace_bytes=1000 * (ctx.tp_rank + 1))

    s = Session(LowlatConfig(mode=mode), Registry([fake_spec(build=build)]))  # type: ignore[arg-type]
    s.configure(fake_setup(tp_size=2))
    s.loaded()
    s.check_model(None)
    s.agree(group)
    try:
        s.build(SHAPE, [], "cpu", torch.float32)
    except Unsupported as exc:
        return "raised", -1, str(exc)
    workspace = s.memory_measured()
    s.kv_sized(64)
    s.install()
    return s.select(Step.decode(1)), workspace, s.explain()


def test_a_build_failing_on_one_rank_turns_the_plugin_off_on_every_rank() -> None:
    out = FakeWorld(2).run(lambda g: _build_session(g, "auto", fail_on=1))
    assert [(p, w) for p, w, _ in out] == [("original", 0), ("original", 0)]
    assert all("rank 1 build: no workspace for this shard" in text for _, _, text in out)
    raised = FakeWorld(2).run(lambda g: _build_session(g, "require", fail_on=0))
    assert [r for r, _, _ in raised] == ["raised", "raised"] and "rank 0 build" in raised[1][2]


def test_every_rank_takes_the_largest_workspace() -> None:
    out = FakeWorld(2).run(lambda g: _build_session(g, "auto", fail_on=-1))
    assert [(p, w) for p, w, _ in out] == [("plugin", 2000), ("plugin", 2000)]


_WORKER = r"""
import json, sys
import torch.distributed as dist
from lowlat import Coverage, StepKind, TorchGroup, agree
rank, world, init = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
group = TorchGroup()
cov = Coverage(frozenset({StepKind.DECODE}), 8 * (rank + 1), 1, 4096 // (rank + 1))
ok = agree("nv", "1", cov, group)
off = agree("nv" if rank == 0 else None, "1", cov if rank == 0 else None, group)
print(json.dumps({"ok": [ok.enabled, ok.coverage.to_table()], "off": [off.enabled, list(off.reasons)]}))
dist.destroy_process_group()
"""


def test_agreement_over_gloo_two_processes(tmp_path: Path) -> None:
    init = f"file://{tmp_path / 'rendezvous'}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen([sys.executable, "-c", _WORKER, str(r), "2", init], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for r in range(2)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results[0] == results[1]
    enabled, table = results[0]["ok"]
    assert enabled and table == {"step_kinds": ["decode"], "max_tokens": 8, "max_query_len": 1, "max_context": 2048}
    assert results[0]["off"][0] is False and "ranks [1]" in results[0]["off"][1][0]

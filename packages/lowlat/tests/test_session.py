"""Session: start-up order, plugin choice, Unsupported vs NotCovered, graph path recorder, explain()."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch

import lowlat
from lowlat import (
    ORIGINAL,
    PLUGIN,
    Coverage,
    GraphPathMismatch,
    LayerShape,
    LowlatConfig,
    LowlatError,
    Registry,
    Requirements,
    Session,
    StartupOrderError,
    Step,
    StepKind,
    Unsupported,
)
from lowlat.testing import EchoBuilt, fake_setup, fake_spec

SHAPE = LayerShape(hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=16)


def start(session: Session, model: Any = None, **setup_kw: Any) -> None:
    session.configure(fake_setup(**setup_kw))
    session.loaded()
    session.check_model(model)
    session.agree(None)
    session.build(SHAPE, [], "cpu", torch.float32)
    session.memory_measured()
    session.kv_sized(128)
    session.install()
    session.warmup([1, 2, 4, 32, 64])


def test_full_startup_selects_highest_priority_and_dispatches() -> None:
    reg = Registry([fake_spec("low", priority=0), fake_spec("high", priority=3, built_max_batch=4)])
    s = Session(LowlatConfig(), reg)
    start(s)
    assert s.selected is not None and s.selected.name == "high"
    assert isinstance(s.built, EchoBuilt) and s.built.warmed == [1, 2, 4]  # others not covered
    assert s.select(Step.decode(2)) == PLUGIN
    assert s.select(Step.decode(8)) == ORIGINAL  # declined by built plugin (max 4)
    assert s.select(Step.decode(32)) == ORIGINAL  # beyond coverage max_tokens 16
    assert s.select(Step(StepKind.EXTEND, 1, 7, 7)) == ORIGINAL
    rep = s.report()
    assert rep.plugin_steps == 1
    reasons = dict(rep.fallbacks)
    assert sum(reasons.values()) == 3 and len(reasons) == 3
    assert rep.workspace_bytes == 1024


@pytest.mark.parametrize("skip", ["loaded", "check_model", "agree", "build"])
def test_startup_order_is_enforced(skip: str) -> None:
    s = Session(LowlatConfig(), Registry([fake_spec()]))
    s.configure(fake_setup())
    steps = {
        "loaded": s.loaded,
        "check_model": lambda: s.check_model(None),
        "agree": lambda: s.agree(None),
        "build": lambda: s.build(SHAPE, [], "cpu", torch.float32),
        "memory_measured": s.memory_measured,
    }
    order = list(steps)
    for name in order:
        if name == skip:
            continue
        if order.index(name) > order.index(skip):
            with pytest.raises(StartupOrderError, match=f"expected {skip}"):
                steps[name]()
            return
        steps[name]()


def test_select_before_install_and_repeated_stage_raise() -> None:
    s = Session(LowlatConfig(), Registry([fake_spec()]))
    with pytest.raises(StartupOrderError):
        s.select(Step.decode(1))
    s.configure(fake_setup())
    with pytest.raises(StartupOrderError):
        s.configure(fake_setup())


def test_unsupported_in_auto_mode_keeps_every_reason_and_falls_back() -> None:
    req = Requirements(vendor="nvidia", dtypes=("bfloat16",), tp_sizes=(1,))
    s = Session(LowlatConfig(mode="auto"), Registry([fake_spec(requirements=req)]))
    start(s, vendor="amd", dtype="float16", tp_size=2)
    v = s.verdicts["fake"]
    assert v.status == "unsupported" and len(v.reasons) == 3
    assert s.select(Step.decode(1)) == ORIGINAL
    (reason, count), = s.report().fallbacks
    assert count == 1 and "no supported plugin" in reason and "vendor" in reason


def test_require_mode_raises_with_all_reasons() -> None:
    req = Requirements(vendor="nvidia", dtypes=("bfloat16",))
    s = Session(LowlatConfig(mode="require"), Registry([fake_spec(requirements=req)]))
    with pytest.raises(Unsupported) as info:
        s.configure(fake_setup(vendor="cpu", dtype="float32"))
    assert len(info.value.reasons) == 2
    again = pickle.loads(pickle.dumps(info.value))  # crosses processes (TP ranks, a server's core) intact
    assert isinstance(again, Unsupported) and again.reasons == info.value.reasons and str(again) == str(info.value)


def test_require_of_a_named_plugin_names_it_and_only_its_reasons() -> None:
    req = Requirements(vendor="nvidia")
    reg = Registry([fake_spec("gpu-only", requirements=req), fake_spec("other")])
    s = Session(LowlatConfig(mode="require", plugins=("gpu-only",)), reg)
    with pytest.raises(Unsupported) as info:
        s.configure(fake_setup(vendor="cpu"))
    assert info.value.plugin == "gpu-only" and "'gpu-only'" in str(info.value)
    assert info.value.reasons and all(r.startswith("gpu-only: ") for r in info.value.reasons)  # not "other: excluded"
    missing = Session(LowlatConfig(mode="require", plugins=("absent",)), Registry([fake_spec("other")]))
    with pytest.raises(Unsupported, match=r"absent: not registered \(registered: other\)"):
        missing.configure(fake_setup())


def test_check_model_turns_a_plugin_off_and_the_next_one_wins() -> None:
    def refuse(model: Any) -> tuple[str, ...]:
        return ("qkv has a bias",) if model == "biased" else ()

    reg = Registry([fake_spec("picky", priority=5, check_model=refuse), fake_spec("plain")])
    s = Session(LowlatConfig(), reg)
    start(s, model="biased")
    assert s.selected is not None and s.selected.name == "plain"
    assert s.verdicts["picky"].reasons == ("qkv has a bias",)
    s2 = Session(LowlatConfig(mode="require"), Registry([fake_spec("picky", check_model=refuse)]))
    s2.configure(fake_setup())
    s2.loaded()
    with pytest.raises(Unsupported, match="bias"):
        s2.check_model("biased")


def test_build_raising_unsupported_turns_the_plugin_off() -> None:
    def build(ctx: Any) -> Any:
        raise Unsupported("fake", ("head_dim 96 not supported",))

    s = Session(LowlatConfig(), Registry([fake_spec(build=build)]))
    start(s)
    assert s.built is None and s.select(Step.decode(1)) == ORIGINAL
    assert "head_dim 96" in s.explain()


def test_build_must_return_a_built() -> None:
    s = Session(LowlatConfig(), Registry([fake_spec(build=lambda ctx: object())]))
    s.configure(fake_setup())
    s.loaded()
    s.check_model(None)
    s.agree(None)
    with pytest.raises(LowlatError, match="not a lowlat.Built"):
        s.build(SHAPE, [], "cpu", torch.float32)


def test_mode_off_and_allow_list() -> None:
    s = Session(LowlatConfig(mode="off"), Registry([fake_spec()]))
    start(s)
    assert s.selected is None and s.verdicts["fake"].status == "excluded"
    s2 = Session(LowlatConfig(plugins=("other",)), Registry([fake_spec("fake"), fake_spec("other")]))
    start(s2)
    assert s2.selected is not None and s2.selected.name == "other"


def test_graph_recorder_checks_replays() -> None:
    s = Session(LowlatConfig(), Registry([fake_spec(coverage=Coverage(max_tokens=4), built_max_batch=4)]))
    start(s)
    assert s.capture(Step.decode(1)) == PLUGIN
    assert s.capture(Step.decode(8)) == ORIGINAL
    for _ in range(3):
        assert s.replay(Step.decode(1)) == PLUGIN
    assert s.replay(Step.decode(8)) == ORIGINAL
    with pytest.raises(GraphPathMismatch, match="no graph was captured"):
        s.replay(Step.decode(2))
    entries = {(e.kind, e.batch_size): e for e in s.recorder.entries()}
    assert entries[(StepKind.DECODE, 1)].replays == 3 and entries[(StepKind.DECODE, 8)].replays == 1
    assert s.built is not None
    s.built.max_batch = 0  # type: ignore[attr-defined]  # coverage changed after capture
    with pytest.raises(GraphPathMismatch, match="froze the plugin path"):
        s.replay(Step.decode(1))


def test_verify_steps_replay_decode_graphs() -> None:
    """A verify step replayed in the decode graph of as many rows: checked against that graph's frozen path,
    counted by kind; `path_for` and `frozen_path` count nothing."""
    cov = Coverage(step_kinds=frozenset({StepKind.DECODE, StepKind.VERIFY}), max_tokens=8, max_query_len=4)
    s = Session(LowlatConfig(), Registry([fake_spec(coverage=cov, built_max_batch=8)]))
    start(s)
    assert s.capture(Step.decode(8)) == PLUGIN
    assert s.frozen_path(StepKind.DECODE, 8) == PLUGIN and s.frozen_path(StepKind.DECODE, 4) is None
    assert s.path_for(Step.verify(8, 4)) == PLUGIN and s.path_for(Step.verify(8, 5)) == ORIGINAL
    assert s.replay(Step.verify(8, 4), graph=(StepKind.DECODE, 8)) == PLUGIN
    assert s.replay(Step.decode(8)) == PLUGIN
    with pytest.raises(GraphPathMismatch, match="froze the plugin path"):
        s.replay(Step.verify(8, 5), graph=(StepKind.DECODE, 8))  # 5 rows of a request: not covered
    report = s.report()
    assert dict(report.plugin_steps_by_kind) == {"decode": 1, "verify": 1}
    assert "steps on plugin: 2 (decode 1, verify 1)" in s.explain()


def test_forward_layer_dispatch() -> None:
    s = Session(LowlatConfig(), Registry([fake_spec()]))
    start(s)
    x = torch.randn(2, 8)
    orig_calls: list[int] = []

    def original(layer: int, x: torch.Tensor, kv: Any, meta: Any) -> torch.Tensor:
        orig_calls.append(layer)
        return x + 1

    out = s.forward_layer(s.select(Step.decode(2)), 3, x, None, None, original)  # type: ignore[arg-type]
    assert out is x and s.built.calls == [3]  # type: ignore[union-attr]
    out2 = s.forward_layer(ORIGINAL, 4, x, None, None, original)  # type: ignore[arg-type]
    assert torch.equal(out2, x + 1) and orig_calls == [4]


def test_explain_and_module_level_scope() -> None:
    s = Session(LowlatConfig(), Registry([fake_spec(coverage=Coverage(max_tokens=2))]))
    start(s)
    s.capture(Step.decode(1))
    s.capture(Step.decode(4))
    s.select(Step.decode(4))
    with pytest.raises(LowlatError, match="no active lowlat session"):
        lowlat.explain()
    with s.activate():
        text = lowlat.explain()
        assert lowlat.report().selected == "fake"
    assert "selected=fake" in text and "bs=4" in text and "4 tokens > max_tokens 2" in text
    assert "fallbacks" in text

"""lowlat plugins inside the engine (`lowlat_plugins`), on the CPU with the real SmolLM2 weights.

The plugin under test runs lowlat's torch reference decoder layer on the weights the adapter
hands it (`lmserver.runner.lowlat_adapter`), so it exercises the whole path: start-up order (configure
before the weights load, build before the KV cache is sized), per-step dispatch from the agreed
coverage (decode steps of at most 2 requests), fallbacks counted by reason, and the engine's KV
pool written by the plugin. Oracle: the same engine with lowlat off, greedy, 3 prompts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from lmserver import Engine
from lowlat import (
    Coverage,
    ForwardMeta,
    KVCache,
    PluginSpec,
    Registry,
    Requirements,
    Unsupported,
    use_registry,
)
from lowlat.build import BuildContext, Built
from lowlat.reference import reference_decoder_layer
from lowlat.spec import Step, StepKind

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea."]
MAX_NEW = [24, 16, 8]  # different lengths: the decode batch shrinks 3 -> 2 -> 1


class ReferenceBuilt:
    """A `lowlat.Built` whose layers are lowlat's torch reference (CPU-capable)."""

    name = "cpu-reference"

    def __init__(self, ctx: BuildContext) -> None:
        self.ctx = ctx
        self.workspace_bytes = 4096
        self.warmed: list[int] = []
        self.layer_calls = 0

    def covers(self, step: Step) -> bool:
        return True

    def forward(self, layer: int, x: torch.Tensor, kv: KVCache, meta: ForwardMeta) -> torch.Tensor:
        self.layer_calls += 1
        # all_reduce: the TP sum (None on one rank), so the layer is exact on shards too
        return reference_decoder_layer(x, self.ctx.weights[layer], kv, meta, self.ctx.shape, self.ctx.all_reduce)

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        self.warmed.extend(batch_sizes)


def _spec(built: list[ReferenceBuilt], vendor: str = "cpu") -> PluginSpec:
    def build(ctx: BuildContext) -> Built:
        built.append(ReferenceBuilt(ctx))
        return built[-1]

    return PluginSpec(
        name="cpu-reference", version="1.0", archs=("LlamaForCausalLM",),
        requirements=Requirements(vendor=vendor, dtypes=("float32",)),
        coverage=Coverage(max_tokens=2), build=build,
    )


def _greedy(engine: Engine) -> list[list[int]]:
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in MAX_NEW]
    out = engine.generate(PROMPTS, params)
    assert isinstance(out, list)
    return [o["output_ids"] for o in out]


def _engine(**kw: Any) -> Engine:
    return Engine(dtype="float32", device="cpu", max_total_tokens=4096, **kw)


def test_plugin_decode_path_gives_the_same_greedy_tokens_and_counts_fallbacks() -> None:
    base = _engine()
    try:
        expected = _greedy(base)
        assert base.core.lowlat is None and base.core.runner.lowlat is None  # off by default
    finally:
        base.shutdown()
    built: list[ReferenceBuilt] = []
    with use_registry(Registry([_spec(built)])):
        engine = _engine(lowlat_plugins="require:cpu-reference")
    try:
        got = _greedy(engine)
        report = engine.core.lowlat.report()  # type: ignore[union-attr]
        stats = engine.core.get_stats()
    finally:
        engine.shutdown()
    assert got == expected
    assert report["selected"] == "cpu-reference" and report["workspace_bytes"] == 4096
    assert built[0].warmed == [1, 2]  # warm-up only for covered sizes
    # decode of 2 then 1 request: (32 - 16) + (48 - 32) plugin steps; each ran all 30 layers
    assert report["plugin_steps"] == (MAX_NEW[1] - MAX_NEW[2]) + (MAX_NEW[0] - MAX_NEW[1])
    assert built[0].layer_calls == 30 * report["plugin_steps"]
    fallbacks = report["fallbacks"]
    assert fallbacks["3 tokens > max_tokens 2"] > 0  # decodes of all 3 requests
    assert any(reason.startswith("step kind extend") for reason in fallbacks)  # the prefill
    assert stats["lowlat_plugin_steps"] == report["plugin_steps"]


def test_unsupported_setups_fall_back_or_fail_loudly() -> None:
    built: list[ReferenceBuilt] = []
    with use_registry(Registry([_spec(built, vendor="nvidia")])):
        engine = _engine(lowlat_plugins="auto")
        try:
            out = engine.generate(PROMPTS[0], {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
            assert isinstance(out, dict) and len(out["output_ids"]) == 4
            report = engine.core.lowlat.report()  # type: ignore[union-attr]
        finally:
            engine.shutdown()
        assert report["selected"] is None and report["plugin_steps"] == 0 and not built
        (verdict,) = report["verdicts"]
        assert verdict["status"] == "unsupported" and any("nvidia" in r for r in verdict["reasons"])
        with pytest.raises(Unsupported, match="nvidia"):
            _engine(lowlat_plugins="require:cpu-reference")
    with pytest.raises(ValueError, match="require:<name>"):
        _engine(lowlat_plugins="sometimes")


@pytest.mark.parametrize(("value", "mode", "plugins", "measured", "measured_only"), [
    ("auto", "auto", (), True, False), (" require:nvidia ", "require", ("nvidia",), True, False),
    ("require:nvidia+all-batches", "require", ("nvidia",), False, False), ("auto+all-batches", "auto", (), False, False),
    ("auto+measured-only", "auto", (), True, True)])
def test_lowlat_plugins_option(value: str, mode: str, plugins: tuple[str, ...], measured: bool,
                               measured_only: bool) -> None:
    from lmserver.runner.lowlat_hook import parse_lowlat_plugins

    config = parse_lowlat_plugins(value)
    assert config is not None
    assert (config.mode, config.plugins, config.measured_coverage, config.measured_only) == (
        mode, plugins, measured, measured_only)


@pytest.mark.parametrize("value", ["require:", "sometimes", "nvidia", "+all-batches", "auto+all", "+measured-only",
                                   "auto+measured"])
def test_lowlat_plugins_option_rejects_nonsense(value: str) -> None:
    from lmserver.runner.lowlat_hook import parse_lowlat_plugins

    assert parse_lowlat_plugins("off") is None and parse_lowlat_plugins("off+all-batches") is None
    with pytest.raises(ValueError, match="lowlat_plugins"):
        parse_lowlat_plugins(value)


@pytest.mark.parametrize(("given", "device", "resolved"), [
    (None, "cuda", "auto+measured-only"), (None, "cuda:1", "auto+measured-only"), (None, "cpu", "off"),
    ("off", "cuda", "off"), ("auto", "cpu", "auto"), ("require:nvidia", "cuda", "require:nvidia"),
])
def test_lowlat_plugins_default_is_auto_on_a_gpu_and_off_on_the_cpu(given: str | None, device: str,
                                                                    resolved: str) -> None:
    from lmserver.config import ServerConfig
    from lmserver.runner.resolve import resolve_lowlat_plugins

    assert ServerConfig(model_path="m").lowlat_plugins is None  # the default: resolved with the device
    assert resolve_lowlat_plugins(given, device) == resolved


def test_eager_decode_warms_every_batch_size_up() -> None:
    # with decode graphs the captured sizes (1, 2, 4, 8, ...) compile the plugin's kernels; eager decode runs each batch
    # at its own size, so start-up warms all of them (Session.warmup keeps those the plugin covers)
    from lmserver.runner.lowlat_hook import WARMUP_BATCH_SIZES, warmup_batch_sizes

    graphs = warmup_batch_sizes(False, "cuda")
    assert graphs == WARMUP_BATCH_SIZES and graphs[0] == 1 and list(graphs) == sorted(set(graphs))
    for eager in (warmup_batch_sizes(True, "cuda"), warmup_batch_sizes(False, "cpu")):
        # every size from 1 up, a superset of the graph sizes (whatever the tables hold)
        assert eager == tuple(range(1, max(eager) + 1)) and set(graphs) <= set(eager)


def _speculative_engine(monkeypatch: pytest.MonkeyPatch, make: Callable[[BuildContext], ReferenceBuilt],
                        graph_max_bs: int) -> tuple[Engine, list[ReferenceBuilt]]:
    """An engine with n-gram speculation (3 drafts: 4 verify rows per request), decode graphs captured eagerly up to
    ``graph_max_bs`` rows, and the plugin built by ``make`` covering decode and verify steps of up to 8 rows (every
    built instance in the list, the last the engine's)."""
    return _plugin_graph_engine(monkeypatch, make, graph_max_bs, speculative_algorithm="ngram",
                                speculative_num_draft_tokens=3)


def _plugin_graph_engine(monkeypatch: pytest.MonkeyPatch, make: Callable[[BuildContext], ReferenceBuilt],
                         graph_max_bs: int, **kw: Any) -> tuple[Engine, list[ReferenceBuilt]]:
    """An engine (options ``kw``) with decode graphs captured eagerly up to ``graph_max_bs`` rows and the plugin
    built by ``make`` covering decode and verify steps of up to 8 rows (every built instance in the list, the last
    the engine's)."""
    from lmserver.runner.cuda_graph import EAGER_GRAPHS_ENV

    built: list[ReferenceBuilt] = []

    def build(ctx: BuildContext) -> Built:
        built.append(make(ctx))
        return built[-1]

    spec = PluginSpec(name="cpu-reference", version="1.0", archs=("LlamaForCausalLM",),
                      requirements=Requirements(vendor="cpu", dtypes=("float32",)),
                      coverage=Coverage(step_kinds=frozenset({StepKind.DECODE, StepKind.VERIFY}), max_tokens=8,
                                        max_query_len=8),
                      build=build)
    monkeypatch.setenv(EAGER_GRAPHS_ENV, "1")
    with use_registry(Registry([spec])):
        engine = _engine(lowlat_plugins="require:cpu-reference", context_length=256, cuda_graph_max_bs=graph_max_bs,
                         **kw)
    return engine, built


class VerifyUpTo4Built(ReferenceBuilt):
    """Covers decode steps, and verify steps of at most 4 rows (a plugin measured slower on larger ones)."""

    def covers(self, step: Step) -> bool:
        return step.kind == StepKind.DECODE or (step.kind == StepKind.VERIFY and step.num_tokens <= 4)


@pytest.mark.slow  # 100 s on 2 cores; the verify rows' kernels: lowlat's interpreter cases, the decode path: below
def test_verify_steps_take_the_plugin_path_their_graph_froze(monkeypatch: pytest.MonkeyPatch) -> None:
    """Speculative verify steps replay decode graphs as decode rows; where the plugin declines verify rows
    that its decode graph serves (8 rows here), a verify graph of that size runs the original path. Oracle:
    greedy tokens of the engine without lowlat or speculation; every replay's path is checked by lowlat."""
    passages = ["The committee met on Tuesday to review the budget and approved the road repairs.",
                "The library opens at nine, closes at six, and lends up to ten books per card."]
    copies = [f"Repeat this text word for word.\nText: {p}\nRepeated:" for p in passages]
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    workloads = [copies[:1], copies]  # alone: 4 verify rows (plugin); together: 8 (the verify graph, original)
    base = _engine()
    try:
        expected = [[o["output_ids"] for o in base.generate(w, params)] for w in workloads]  # type: ignore[index]
    finally:
        base.shutdown()
    engine, _ = _speculative_engine(monkeypatch, VerifyUpTo4Built, graph_max_bs=8)
    try:
        graphs = engine.core.runner.cuda_graph
        assert graphs is not None and sorted(graphs.verify_graphs) == [8]  # only where the paths differ
        got = [[o["output_ids"] for o in engine.generate(w, params)] for w in workloads]  # type: ignore[index]
        stats = engine.core.get_stats()
        report = engine.core.lowlat.report()  # type: ignore[union-attr]
    finally:
        engine.shutdown()
    assert got == expected
    assert stats["cuda_graph_verify_replays"] > 0 and stats["spec_accepted_tokens"] > 0
    assert stats.get("lowlat_plugin_steps_verify", 0) > 0  # verify steps of <= 4 rows ran the plugin
    graph_paths = {g.split(" -> ")[0]: g for g in report["graphs"]}
    assert any("verify" in g and "original" in g for g in graph_paths.values()), report["graphs"]


class VerifyLaunchBuilt(ReferenceBuilt):
    """Launches verify rows otherwise than decode rows (``Built``'s optional ``verify_launch_differs``, as the nvidia
    stack with ``LaunchConfig.verify_attn_warps``); records each step's ``ForwardMeta.rows_per_request``."""

    verify_launch_differs = True

    def __init__(self, ctx: BuildContext) -> None:
        super().__init__(ctx)
        self.rows_seen: list[int] = []

    def forward(self, layer: int, x: torch.Tensor, kv: KVCache, meta: ForwardMeta) -> torch.Tensor:
        if layer == 0:
            self.rows_seen.append(meta.rows_per_request)
        return super().forward(layer, x, kv, meta)


@pytest.mark.slow  # ~60 s on 2 cores (two engines, graphs captured eagerly on the CPU)
def test_verify_steps_replay_graphs_of_their_own_where_the_plugin_launch_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plugin whose verify launch differs from its decode launch gets a verify graph at every captured size of
    at least 2 rows (its rows per request: the verify rows, at most the size), replayed for verify steps with
    ``rows_per_request`` > 1, while decode steps keep 1. Oracle: greedy tokens of the engine without lowlat or
    speculation; every replay's path is checked by lowlat."""
    prompt = ("Repeat this text word for word.\nText: The committee met on Tuesday to review the budget and approved "
              "the road repairs.\nRepeated:")
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    base = _engine()
    try:
        expected = [o["output_ids"] for o in base.generate([prompt], params)]  # type: ignore[index]
    finally:
        base.shutdown()
    engine, built = _speculative_engine(monkeypatch, VerifyLaunchBuilt, graph_max_bs=4)
    try:
        graphs = engine.core.runner.cuda_graph
        assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4]
        assert sorted(graphs.verify_graphs) == [2, 4]  # one row per request at size 1: the decode launch
        assert isinstance(built[-1], VerifyLaunchBuilt)
        built[-1].rows_seen.clear()
        got = [o["output_ids"] for o in engine.generate([prompt], params)]  # type: ignore[index]
        stats = engine.core.get_stats()
        report = engine.core.lowlat.report()  # type: ignore[union-attr]
    finally:
        engine.shutdown()
    assert got == expected
    assert stats["cuda_graph_verify_replays"] > 0 and stats["spec_accepted_tokens"] > 0
    assert stats.get("lowlat_plugin_steps_verify", 0) > 0
    rows_seen = built[-1].rows_seen  # type: ignore[attr-defined]
    assert set(rows_seen) - {1}, rows_seen  # verify replays ran their own launch
    assert all("plugin" in g for g in report["graphs"]), report["graphs"]


@pytest.mark.slow  # ~15 s (two engines, graphs captured eagerly on the CPU)
def test_short_extends_replay_verify_graphs_where_the_plugin_launch_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Graph extends (the default) with a plugin whose launch for several rows of one request differs from its decode
    launch: every captured size of at least 2 rows gets a verify graph, which runs extends of 2-4 new tokens (a
    fresh 2-token prompt, radix hits' suffixes of 3 and 2 tokens); a 1-token suffix is a decode step and replays the
    decode graph. Oracle: greedy tokens and the first output's logprob of the engine without lowlat or graphs;
    every replay's path is checked by lowlat."""
    base_ids = list(range(300, 340))
    prompts = [base_ids[:2], base_ids[:30], base_ids[:33], base_ids[:35], base_ids[:36]]  # hits after the 2nd
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}

    def outputs(engine: Engine) -> list[tuple[list[int], float]]:
        outs = []
        for ids in prompts:  # one at a time: each later prompt's prefix is cached
            o = engine.generate(input_ids=ids, sampling_params=params, return_logprob=True)
            outs.append((o["output_ids"], o["meta_info"]["output_token_logprobs"][0][0]))  # type: ignore[index]
        return outs

    base = _engine(disable_cuda_graph=True)
    try:
        expected = outputs(base)
    finally:
        base.shutdown()
    engine, built = _plugin_graph_engine(monkeypatch, VerifyLaunchBuilt, graph_max_bs=4)
    try:
        graphs = engine.core.runner.cuda_graph
        assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4] and graphs.extend_max_reads > 0
        assert sorted(graphs.verify_graphs) == [2, 4]
        built[-1].rows_seen.clear()  # type: ignore[attr-defined]
        got = outputs(engine)
        replays = graphs.num_extend_replays
        report = engine.core.lowlat.report()  # type: ignore[union-attr]
    finally:
        engine.shutdown()
    assert [ids for ids, _ in got] == [ids for ids, _ in expected]
    assert [lp for _, lp in got] == pytest.approx([lp for _, lp in expected], abs=1e-4)
    assert replays == 4  # the 2-token prompt and the suffixes of 3, 2 and 1 tokens (the 30-token prompt: eager)
    rows_seen = built[-1].rows_seen  # type: ignore[attr-defined]
    assert {2, 4} <= set(rows_seen) and 1 in rows_seen, rows_seen  # verify graphs of 2 and 4 rows; decode rows
    assert all("plugin" in g for g in report["graphs"]), report["graphs"]


class ReusingOutputBuilt(ReferenceBuilt):
    """Returns every layer's output in one buffer per shape, as a plugin writing its workspace does."""

    def __init__(self, ctx: BuildContext) -> None:
        super().__init__(ctx)
        self.out: dict[tuple[int, ...], torch.Tensor] = {}

    def forward(self, layer: int, x: torch.Tensor, kv: KVCache, meta: ForwardMeta) -> torch.Tensor:
        y = super().forward(layer, x, kv, meta)
        return self.out.setdefault(tuple(y.shape), torch.empty_like(y)).copy_(y)


@pytest.mark.slow  # ~15 s (three engines, graphs captured eagerly on the CPU)
def test_an_eagle3_head_reads_its_target_layers_from_the_plugin_path(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    """An EAGLE-3 head (random, over the embedded model: target layers 1, 14, 26) with the plugin on decode and
    verify steps (graphs captured eagerly) is fed the features the model's own forward gives it: every observation
    equal to the engine's without the plugin within 1e-4, the same drafts; outputs equal plain decoding's."""
    from lmserver.runner.cuda_graph import EAGER_GRAPHS_ENV
    from lmserver.testing import record_eagle, write_eagle3_head

    base = _engine()
    try:
        hf = base.core.model_config.hf_config
        params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
        expected = [o["output_ids"] for o in base.generate(PROMPTS[:2], params)]  # type: ignore[index]
    finally:
        base.shutdown()
    head = dict(architectures=["LlamaForCausalLM"], vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                intermediate_size=256, num_hidden_layers=1, num_attention_heads=hf["num_attention_heads"],
                num_key_value_heads=hf["num_key_value_heads"], max_position_embeddings=2048,
                rms_norm_eps=hf.get("rms_norm_eps", 1e-5), rope_theta=hf.get("rope_theta", 10000.0))
    write_eagle3_head(tmp_path / "eagle3", head, draft_vocab=4096)
    record = record_eagle(monkeypatch)
    kw = dict(speculative_algorithm="eagle", speculative_draft_model_path=str(tmp_path / "eagle3"),
              speculative_num_draft_tokens=3)
    runs = []
    for plugin in (True, False):
        if plugin:
            engine, _ = _plugin_graph_engine(monkeypatch, ReusingOutputBuilt, graph_max_bs=4, **kw)
        else:
            monkeypatch.setenv(EAGER_GRAPHS_ENV, "1")
            engine = _engine(context_length=256, cuda_graph_max_bs=4, **kw)
        try:
            assert engine.core.runner.aux_hidden
            got = [o["output_ids"] for o in engine.generate(PROMPTS[:2], params)]  # type: ignore[index]
            stats = engine.core.get_stats()
            engine.core.check_memory_invariant()
        finally:
            engine.shutdown()
        assert got == expected
        assert stats["spec_draft_tokens"] > 0 and stats["cuda_graph_verify_replays"] > 0, stats
        assert (stats.get("lowlat_plugin_steps_verify", 0) > 0) == plugin, stats
        runs.append(record.take())
    plugin_run, model_run = runs
    plugin_run.assert_same_as(model_run, width=3 * hf["hidden_size"], tol=1e-4)  # three target layers side by side

"""lmserver -> lowlat adapter: a tiny random lmserver Llama (and Mixtral) decode step through the
lowlat plugin path against lmserver's own layer forward, outputs and KV pool writes compared.

``test_reference_path_*`` runs lowlat's torch reference on the adapted weights (plain CPU, checks the
weight/KV/metadata mapping); ``test_plugin_path_*`` runs the ``nvidia`` plugin's Triton kernels in
a child process under TRITON_INTERPRET=1 (it must be set before triton is imported), or on a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmserver.forward.batch import ForwardBatch, ForwardMode
from lmserver.forward.kv_pool import KVPool, make_req_to_token
from lmserver.models.config import ModelConfig
from lmserver.runner.attention.torch_native import TorchNativeBackend
from lmserver.runner.lowlat_adapter import (
    LowlatAdapterError,
    decode_forward,
    forward_meta,
    kv_caches,
    plugin_layers,
)

ROOT = Path(__file__).resolve().parents[3]
NUM_SLOTS, MAX_CONTEXT = 96, 32


def _config(num_experts: int = 0, **kw: object) -> ModelConfig:
    base: dict[str, object] = dict(
        architecture="MixtralForCausalLM" if num_experts else "LlamaForCausalLM", vocab_size=61, hidden_size=64,
        intermediate_size=96 if not num_experts else 32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=64, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        num_experts=num_experts, num_experts_per_tok=2 if num_experts else 0,
    )
    base.update(kw)
    return ModelConfig(**base)  # type: ignore[arg-type]


def _model(config: ModelConfig, device: torch.device) -> torch.nn.Module:
    from lmserver.models.llama import LlamaForCausalLM
    from lmserver.models.mixtral import MixtralForCausalLM

    torch.manual_seed(3)
    model = (MixtralForCausalLM if config.num_experts else LlamaForCausalLM)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("gate.weight"):  # router: spread logits so top-k choices are clear
                p.copy_(torch.randn_like(p) * 6 / p.shape[-1] ** 0.5)
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return model.to(device).eval()


def _decode_batch(device: torch.device, g: torch.Generator) -> tuple[ForwardBatch, torch.Tensor]:
    """A decode batch of 3 requests (rows 4, 0, 2 of the table) at lengths 7, 1, 20 over scattered slots."""
    table = make_req_to_token(6, MAX_CONTEXT, device)
    rows, lens = [4, 0, 2], [7, 1, 20]
    slots = (torch.randperm(NUM_SLOTS - 1, generator=g) + 1)[: sum(lens)].to(device)  # slot 0 is padding
    start = 0
    for r, n in zip(rows, lens, strict=True):
        table[r, :n] = slots[start : start + n].to(torch.int32)
        start += n
    rows_t = torch.tensor(rows, device=device)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    batch = ForwardBatch(
        mode=ForwardMode.DECODE, batch_size=3, input_ids=torch.randint(0, 61, (3,), generator=g).to(device),
        positions=(lens_t - 1).long(), out_cache_loc=table[rows_t, lens_t.long() - 1].long(), req_pool_indices=rows_t,
        seq_lens=lens_t, seq_lens_cpu=lens,
    )
    return batch, table


def _pools(config: ModelConfig, device: torch.device, g: torch.Generator, kv_fp8: bool = False) -> tuple[KVPool, KVPool]:
    # FP8: per-layer K / V scales, powers of two (lmserver's store divides by the scale, lowlat multiplies by its
    # reciprocal: the same values only when the reciprocal is exact)
    fp8 = dict(kv_cache_dtype=torch.float8_e4m3fn, k_scales=[0.5, 0.25], v_scales=[0.25, 2.0]) if kv_fp8 else {}
    pools = tuple(KVPool(NUM_SLOTS, config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                         torch.float32, device, **fp8) for _ in range(2))  # type: ignore[arg-type]
    for i in range(config.num_hidden_layers):  # random stale contents: the cached tokens of each request
        for cache in ("k_cache", "v_cache"):
            noise = torch.randn(NUM_SLOTS, config.num_key_value_heads, config.head_dim, generator=g).to(device)
            for pool in pools:
                getattr(pool, cache)[i].copy_(noise.to(pool.dtype))
    return pools  # type: ignore[return-value]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert not torch.isnan(a).any()
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def compare_decode_step(num_experts: int, plugin: bool, fp8: bool = False, aux_layers: tuple[int, ...] = (),
                        reuse_output: bool = False) -> None:
    """One decode step: lmserver's model forward (torch_native attention) vs the adapted lowlat path. ``fp8``: the
    model's projections quantized online (``quantize_linears_``, per-channel scales; Mixtral: its experts too,
    ``quantize_moe_experts_``, per-row scales) and an FP8 KV pool. ``aux_layers`` (EAGLE-3): the residual stream
    after those layers (``model.model.aux_hidden``) compared too; ``reuse_output``: the reference plugin returns
    every layer's output in one buffer, as a plugin writing its workspace does."""
    device = torch.device("cuda" if plugin and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")
    config = _config(num_experts, num_hidden_layers=3) if aux_layers else _config(num_experts)
    model = _model(config, device)
    model.model.aux_layers = aux_layers  # type: ignore[union-attr]
    if fp8:
        from lmserver.models.quantization import quantize_linears_, quantize_moe_experts_, use_fp8_path

        quantize_linears_(model, None)
        quantize_moe_experts_(model)
        use_fp8_path(model, device)
    g = torch.Generator().manual_seed(7)
    batch, table = _decode_batch(device, g)
    pool_ref, pool_ll = _pools(config, device, g, kv_fp8=fp8)
    stale_k = [k.clone() for k in pool_ll.k_cache]
    backend = TorchNativeBackend(pool_ref, table)
    backend.plan(batch)
    batch.attn_backend = backend
    with torch.no_grad():
        want = model(batch.input_ids, batch.positions, batch)
        want_aux, model.model.aux_hidden = model.model.aux_hidden, None  # type: ignore[union-attr]
        layers = plugin_layers(model)
        kvs = kv_caches(pool_ll)
        if plugin:
            from lowlat import Coverage, LowlatConfig
            from lowlat.build import BuildContext
            from lowlat.plugins.nvidia import build
            from lowlat.testing import fake_setup

            kv_dtype = pool_ll.dtype
            ctx = BuildContext(layers.shape, () if layers.moe else layers.weights, device, torch.float32, kv_dtype,  # type: ignore[arg-type]
                               Coverage(max_tokens=4), LowlatConfig(), fake_setup(vendor=device.type, arch=config.architecture),
                               MAX_CONTEXT, moe=layers.moe, moe_weights=layers.weights if layers.moe else ())  # type: ignore[arg-type]
            built = build(ctx)
        else:
            built = _ReferenceBuilt(layers, reuse_output)
        got = decode_forward(model, built, batch, kvs, table, max_seq_len=max(batch.seq_lens_cpu))
    tol = 1e-4 if device.type == "cpu" else 3e-3  # GPU float32 dots may run in TF32
    assert _rel(got, want) < tol, _rel(got, want)
    if aux_layers:
        got_aux = model.model.aux_hidden  # type: ignore[union-attr]
        assert want_aux is not None and got_aux is not None and got_aux.shape == want_aux.shape
        assert want_aux.shape == (batch.batch_size, len(set(aux_layers)) * config.hidden_size)
        assert _rel(got_aux, want_aux) < tol, _rel(got_aux, want_aux)
    for i in range(config.num_hidden_layers):
        # whole caches compared: the new tokens' slots written alike, every other slot untouched
        assert _rel(pool_ll.k_cache[i], pool_ref.k_cache[i]) < tol and _rel(pool_ll.v_cache[i], pool_ref.v_cache[i]) < tol
        assert not torch.equal(pool_ll.k_cache[i][batch.out_cache_loc], stale_k[i][batch.out_cache_loc])
    if fp8:
        assert layers.weights[0].fp8 and pool_ll.is_fp8  # type: ignore[union-attr]


class _ReferenceBuilt:
    """lowlat's torch reference layer as a ``Built`` (checks the adapter's mapping without Triton)."""

    name = "reference"
    workspace_bytes = 0

    def __init__(self, layers, reuse_output: bool = False) -> None:  # type: ignore[no-untyped-def]
        self.layers = layers
        self.out: torch.Tensor | None = None if not reuse_output else torch.empty(0)

    def covers(self, step: object) -> bool:
        return True

    def warmup(self, batch_sizes: object) -> None:
        return None

    def forward(self, layer: int, x: torch.Tensor, kv, meta) -> torch.Tensor:  # type: ignore[no-untyped-def]
        from lowlat import reference_decoder_layer
        from lowlat.moe import reference_moe_decoder_layer

        w = self.layers.weights[layer]
        if self.layers.moe is not None:
            y = reference_moe_decoder_layer(x, w, kv, meta, self.layers.shape, self.layers.moe)
        else:
            y = reference_decoder_layer(x, w, kv, meta, self.layers.shape)
        if self.out is None:
            return y
        if self.out.shape != y.shape:
            self.out = torch.empty_like(y)
        return self.out.copy_(y)  # every layer's output in the same storage


@pytest.mark.parametrize("num_experts", [0, 4], ids=["llama", "mixtral"])
def test_reference_path_matches_lmserver_forward(num_experts: int) -> None:
    compare_decode_step(num_experts, plugin=False)


@pytest.mark.parametrize("num_experts", [0, 4], ids=["llama", "mixtral"])
def test_reference_path_matches_lmserver_fp8_forward(num_experts: int) -> None:
    """FP8 weights (per-channel scales, views of the model's Fp8Linear buffers; Mixtral: FP8 experts with per-row
    scales too) and an FP8 KV pool with its scales."""
    compare_decode_step(num_experts, plugin=False, fp8=True)


@pytest.mark.parametrize("num_experts", [0, 4], ids=["llama", "mixtral"])
def test_reference_path_leaves_the_eagle3_aux_hidden_states(num_experts: int) -> None:
    """EAGLE-3 heads read the residual stream after some target layers: the plugin path leaves it as the model's
    forward does (layers named out of order, each a copy taken before the plugin reuses its output buffer)."""
    compare_decode_step(num_experts, plugin=False, aux_layers=(2, 0), reuse_output=True)


def _fp8_mixtral(attention: bool = True, block: tuple[int, int] | None = None) -> torch.nn.Module:
    """A tiny Mixtral with FP8 experts (lmserver's ``MoE`` layout: per-row scales quantized online, or empty
    ``block``-scaled ones as a block checkpoint holds them before loading) and FP8 attention projections
    (``attention``)."""
    from lmserver.models.quantization import quantize_linears_, quantize_moe_experts_

    model = _model(_config(4), torch.device("cpu"))
    if attention:
        quantize_linears_(model, None)
    if block is None:
        quantize_moe_experts_(model)
    else:
        for layer in model.model.layers:  # type: ignore[union-attr]
            layer.mlp.use_fp8_(block)
    return model


def test_fp8_experts_are_passed_as_views_with_their_scales() -> None:
    model = _fp8_mixtral()
    layers = plugin_layers(model)
    assert layers.moe is not None
    for w, layer in zip(layers.weights, model.model.layers, strict=True):  # type: ignore[union-attr, arg-type]
        assert w.fp8 and w.w13.dtype == torch.float8_e4m3fn  # type: ignore[union-attr]
        for name in ("w13", "w2", "w13_scale", "w2_scale"):
            assert getattr(w, name).data_ptr() == getattr(layer.mlp, name).data_ptr(), name
        assert w.qkv_scale is not None and w.o_proj_scale is not None  # type: ignore[union-attr]
        assert w.router.dtype == torch.float32  # type: ignore[union-attr]  # the router stays in the model dtype
        w.validate(layers.shape, layers.moe)  # type: ignore[call-arg]


def test_adapter_refuses_fp8_block_scales_and_fp8_in_half_a_moe_layer() -> None:
    from lmserver.models.quantization import quantize_linears_

    model = _model(_config(), torch.device("cpu"))
    quantize_linears_(model, 32)  # one scale per (row, 32 columns): a block-scaled checkpoint's layout
    with pytest.raises(LowlatAdapterError, match="one scale per output row"):
        plugin_layers(model)
    moe = _model(_config(4), torch.device("cpu"))
    quantize_linears_(moe, None)  # FP8 attention, model-dtype experts
    with pytest.raises(LowlatAdapterError, match="FP8 attention projections with model-dtype experts"):
        plugin_layers(moe)
    with pytest.raises(LowlatAdapterError, match="FP8 experts with model-dtype attention projections"):
        plugin_layers(_fp8_mixtral(attention=False))
    with pytest.raises(LowlatAdapterError, match="FP8 experts with scales per 128 x 128 block"):
        plugin_layers(_fp8_mixtral(block=(128, 128)))


def test_adapter_refuses_bias_qk_norm_and_extend() -> None:
    with pytest.raises(LowlatAdapterError, match="attention bias"):
        plugin_layers(_model(_config(attention_bias=True), torch.device("cpu")))
    batch, table = _decode_batch(torch.device("cpu"), torch.Generator().manual_seed(1))
    batch.mode = ForwardMode.EXTEND
    with pytest.raises(LowlatAdapterError, match="decode steps only"):
        forward_meta(batch, table)


def test_adapted_weights_are_views_of_the_model() -> None:
    model = _model(_config(), torch.device("cpu"))
    w = plugin_layers(model).weights[1]
    assert w.qkv.data_ptr() == model.model.layers[1].self_attn.qkv_proj.weight.data_ptr()  # type: ignore[union-attr]


@pytest.mark.parametrize("num_experts", [0, 4], ids=["llama", "mixtral"])
@pytest.mark.parametrize("tp", [2, 4])  # 4: each of the 2 KV heads on two ranks
def test_sharded_model_gives_lowlat_shards_of_the_whole_layers(num_experts: int, tp: int) -> None:
    """lmserver's shards of a model (`shard_model_`) as the adapter passes them to a plugin equal lowlat's own
    shards of the whole layers (`lowlat.tp`), and the shape counts one rank's heads and features: a plugin that
    shards its test inputs with `lowlat.tp` runs what a TP server gives it."""
    import copy

    from lmserver.runner.distributed import TPGroup, shard_model_
    from lowlat.tp import rank_moe_shape, rank_shape, shard_layer, shard_moe_layer

    config = _config(num_experts)
    model = _model(config, torch.device("cpu"))
    whole = plugin_layers(model)
    for rank in range(tp):
        part = plugin_layers(shard_model_(copy.deepcopy(model), config, TPGroup(rank, tp)), tp)
        assert part.shape == rank_shape(whole.shape, tp)
        if num_experts:
            assert whole.moe is not None and part.moe == rank_moe_shape(whole.moe, tp)
        for w, got in zip(whole.weights, part.weights, strict=True):
            want = (shard_moe_layer(w, whole.shape, whole.moe, rank, tp) if whole.moe is not None  # type: ignore[arg-type]
                    else shard_layer(w, whole.shape, rank, tp))  # type: ignore[arg-type]
            for name in ("input_norm", "qkv", "o_proj", "post_norm", "rope_inv_freq",
                         *(("router", "w13", "w2") if num_experts else ("gate_up", "down"))):
                assert torch.equal(getattr(got, name), getattr(want, name)), (rank, name)


def _child(env_extra: dict[str, str]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("LMSYS_GPU_ONLY", "TRITON_INTERPRET")}
    env.update(env_extra)
    code = (f"import runpy; f = runpy.run_path({str(Path(__file__))!r})['compare_decode_step']; "
            "f(0, plugin=True); f(4, plugin=True); f(0, plugin=True, fp8=True); f(4, plugin=True, fp8=True); "
            "print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-4000:] + proc.stderr[-4000:]


def test_plugin_path_matches_lmserver_forward_under_the_interpreter() -> None:
    _child({"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""})


@pytest.mark.gpu
def test_plugin_path_matches_lmserver_forward_on_the_gpu() -> None:
    _child({})



@pytest.mark.parametrize(("quantization", "kv", "hf_extra"), [
    ("fp8", "fp8_e4m3", {}), (None, "auto", {"quantization_config": {"quant_method": "fp8"}}), (None, "auto", {})])
def test_hook_puts_fp8_weights_and_kv_into_the_setup(quantization: str | None, kv: str,
                                                     hf_extra: dict[str, object]) -> None:
    """`--quantization fp8` or an FP8 checkpoint: the FP8_WEIGHTS feature (the amd plugin is refused for it, with the
    reason in explain()); `--kv-cache-dtype fp8_e4m3`: the set-up's KV dtype, and the plugin's KV slots counted in
    FP8 bytes."""
    from lmserver.runner.lowlat_hook import LowlatHook
    from lowlat import FP8_WEIGHTS, Registry
    from lowlat.plugins.amd import spec as amd_spec
    from lowlat.plugins.nvidia import spec as nvidia_spec

    config = _config(hf_config={"model_type": "llama", **hf_extra})
    hook = LowlatHook.start("auto", config, "bfloat16", "cpu", 1, MAX_CONTEXT, quantization=quantization,
                            kv_cache_dtype=kv, registry=Registry([nvidia_spec, amd_spec]))
    assert hook is not None and hook.session.setup is not None
    fp8_weights = quantization == "fp8" or bool(hf_extra)
    assert (FP8_WEIGHTS in hook.session.setup.features) == fp8_weights
    assert hook.session.setup.kv_dtype == ("fp8_e4m3" if kv == "fp8_e4m3" else "bfloat16")
    text = hook.explain()
    assert (f"cannot run with server feature '{FP8_WEIGHTS}'" in text) == fp8_weights
    per_slot = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim  # bytes of one FP8 slot
    tokens = hook.kv_tokens(1000, 10 * per_slot, config, torch.bfloat16)
    assert tokens == (990 if kv == "fp8_e4m3" else 995)


@pytest.mark.parametrize("value", ["auto+measured-only", "auto", "require:cpu-reference"])
def test_an_adapter_refusal_falls_back_with_its_reason_unless_required(value: str) -> None:
    """An FP8 Mixtral the adapter cannot map (block-scaled experts) under the server's GPU default
    (`auto+measured-only`) or `auto`: no plugin, no workspace, the reason in explain(), the model's forward serves
    every step (start-up goes on); `require:` raises it at start-up."""
    from lmserver.runner.lowlat_hook import LowlatHook
    from lowlat import Coverage, PluginSpec, Registry, Requirements, Unsupported

    built: list[object] = []
    spec = PluginSpec(name="cpu-reference", version="1.0", archs=("MixtralForCausalLM",),
                      requirements=Requirements(vendor="cpu", dtypes=("float32",)), coverage=Coverage(max_tokens=2),
                      build=lambda ctx: built.append(ctx) or _ReferenceBuilt(ctx))  # type: ignore[func-returns-value]
    config = _config(4)
    view = _fp8_mixtral(block=(128, 128))
    hook = LowlatHook.start(value, config, "float32", "cpu", 1, MAX_CONTEXT, quantization="fp8",
                            registry=Registry([spec]))
    assert hook is not None
    if value.startswith("require"):
        with pytest.raises(Unsupported, match="128 x 128 block"):
            hook.after_load(view, torch.device("cpu"), torch.float32)
        return
    assert hook.after_load(view, torch.device("cpu"), torch.float32) == 0
    report = hook.report()
    assert report["selected"] is None and not built
    assert any("128 x 128 block" in r for v in report["verdicts"] for r in v["reasons"])
    assert "128 x 128 block" in hook.explain()

"""FP8 (e4m3) MoE experts on the CPU: the expert layout's quantize / dequantize helpers, the MoE layer's dequantizing
torch paths against a per-token float64 oracle, online quantization of a tiny Mixtral end to end through the engine,
tiny FP8 Mixtral checkpoints in each published layout (written by the test), missing scales refused before the
server is ready, and the fused kernels under the interpreter (test_fp8_moe_kernels.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lmserver.kernels.fp8_ref import FP8_DTYPE, dequantize_fp8, quantize_fp8
from lmserver.layers.fp8_linear import Fp8Linear
from lmserver.layers.moe import (
    MoE,
    dequantize_experts,
    moe_forward_dense,
    quantize_experts,
)
from lmserver.models.loader import ModelLoadError, load_model, read_model_config
from lmserver.testing.word_tokenizer import save_word_level_tokenizer

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2)
# decoder weights an FP8 Mixtral checkpoint holds in FP8 (the router `block_sparse_moe.gate` stays in the model dtype)
FP8_WEIGHTS = ("q_proj", "k_proj", "v_proj", "o_proj", "w1", "w2", "w3")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- the layout helpers and the layer's torch paths ------------------------------------------------------


def test_quantize_experts_is_per_row_amax_over_448() -> None:
    w = torch.randn(3, 20, 40, generator=_gen(0)) * torch.rand(3, 20, 1, generator=_gen(1)) * 5
    w[1, 4] = 0.0  # an all-zero row dequantizes to zeros
    q, scale = quantize_experts(w)
    assert q.dtype == FP8_DTYPE and scale.shape == (3, 20) and scale.dtype == torch.float32
    for e in range(3):
        qe, se = quantize_fp8(w[e])  # the dense layers' per-channel quantizer, row by row
        assert torch.equal(q[e].view(torch.uint8), qe.view(torch.uint8)) and torch.equal(scale[e], se[:, 0])
    back = dequantize_experts(q, scale, None, torch.float64)
    assert torch.equal(back[1, 4], torch.zeros(40, dtype=torch.float64))
    # e4m3 keeps 3 mantissa bits: every value within 2^-4 relative of its row maximum (normal range)
    err = (back - w.double()).abs() / w.double().abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    assert float(err.max()) <= 2**-4
    torch.testing.assert_close(scale, w.abs().amax(dim=-1).clamp_min(1e-12) / 448, rtol=1e-6, atol=1e-12)
    # 16 x 16 blocks, the last ones cut at 20 rows and 40 columns: each block's absolute maximum / 448
    qb, sb = quantize_experts(w, (16, 16))
    assert sb.shape == (3, 2, 3)
    for e, r, c in ((0, 0, 0), (1, 1, 2), (2, 1, 1), (1, 0, 0)):
        assert float(sb[e, r, c]) == float(w[e, r * 16:(r + 1) * 16, c * 16:(c + 1) * 16].abs().max() / 448)
    back = dequantize_experts(qb, sb, (16, 16), torch.float64)
    assert float((back - w.double()).norm() / w.double().norm()) < 2**-4


def test_dequantize_experts_with_blocks_is_the_elementwise_product() -> None:
    g = _gen(2)
    q = (torch.randn(2, 70, 50, generator=g) * 30).to(FP8_DTYPE)
    scale = torch.rand(2, 3, 2, generator=g)  # 32 x 32 blocks: the last ones cut at 70 rows, 50 columns
    want = torch.empty(2, 70, 50, dtype=torch.float64)
    for e in range(2):
        for n in range(70):
            for k in range(50):
                want[e, n, k] = float(q[e, n, k].float()) * float(scale[e, n // 32, k // 32])
    assert torch.equal(dequantize_experts(q, scale, (32, 32), torch.float64), want)
    assert torch.equal(dequantize_experts(q[1], scale[1], (32, 32), torch.float64), want[1])  # one expert


def oracle(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int) -> torch.Tensor:
    """Token by token in float64 on (dequantized) expert weights: softmax, top-k, renormalize, sum of weight x
    down(silu(gate) * up)."""
    x, logits, w13, w2 = x.double(), logits.double(), w13.double(), w2.double()
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        top = torch.topk(torch.softmax(logits[t], -1), top_k)
        for p, e in zip(top.values / top.values.sum(), top.indices.tolist(), strict=True):
            gu = w13[e] @ x[t]
            out[t] += p * (w2[e] @ (F.silu(gu[:inter]) * gu[inter:]))
    return out


@pytest.mark.parametrize("block", [None, (32, 32)], ids=["rows", "blocks"])
def test_fp8_moe_layer_torch_paths_match_the_oracle(block: tuple[int, int] | None) -> None:
    g = _gen(3)
    moe = MoE(64, 48, num_experts=4, top_k=2)
    with torch.no_grad():
        moe.gate.weight.copy_(torch.randn(4, 64, generator=g))
        w13 = torch.randn(4, 96, 64, generator=g) / 8
        w2 = torch.randn(4, 64, 48, generator=g) / 7
        if block is None:
            moe.w13.copy_(w13)
            moe.w2.copy_(w2)
            moe.quantize_fp8_()
        else:
            moe.use_fp8_(block)
            for param, scale, w in ((moe.w13, moe.w13_scale, w13), (moe.w2, moe.w2_scale, w2)):
                q, s = quantize_experts(w, block)
                param.copy_(q)
                assert scale is not None and scale.shape == s.shape
                scale.copy_(s)
    assert moe.is_fp8 and moe.w13.dtype == FP8_DTYPE and moe.scale_block == block
    assert isinstance(moe.gate, nn.Linear) and moe.gate.weight.dtype == torch.float32  # the router stays
    assert moe.w13_scale is not None and moe.w2_scale is not None
    d13 = dequantize_experts(moe.w13, moe.w13_scale, block, torch.float64)
    d2 = dequantize_experts(moe.w2, moe.w2_scale, block, torch.float64)
    assert float((d13 - w13.double()).norm() / w13.double().norm()) < 0.05  # FP8's error, not a wrong layout
    x = torch.randn(9, 64, generator=g)
    with torch.no_grad():
        want = oracle(x, moe.gate(x), d13, d2, 2)
        torch.testing.assert_close(moe(x).double(), want, rtol=1e-4, atol=1e-5)
        dense = moe_forward_dense(x, moe.gate(x), moe.w13, moe.w2, 2, scales=(moe.w13_scale, moe.w2_scale, block))
        torch.testing.assert_close(dense.double(), want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="FP8 already"):
        moe.quantize_fp8_()


def test_fp8_moe_kernels_under_interpreter() -> None:  # the fused FP8 kernels' CPU oracle: in the default tier
    from lmserver.kernels.testing import assert_interpreter_run_passed, pytest_under_interpreter

    pytest.importorskip("triton")
    assert_interpreter_run_passed(pytest_under_interpreter(Path(__file__).with_name("test_fp8_moe_kernels.py")))


# --- tiny Mixtral models: online quantization, checkpoints ------------------------------------------------


def _hf_mixtral(tmp_path: Path, **overrides: Any) -> tuple[Any, Path]:
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**{**TINY, **overrides})).eval()
    folder = tmp_path / "bf16"
    model.save_pretrained(folder)
    return model, folder


def _fp8_twin_(model: nn.Module) -> int:
    """`model`'s (HF Mixtral) decoder weights replaced by their online FP8 values, dequantized: what lmserver's
    `--quantization fp8` computes with (per output channel / expert row, absolute max / 448); returns how many
    expert weights (one expert's w1, w2 or w3 each) it replaced. Mutates `model`."""
    experts = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            leaf = name.rpartition(".")[2]
            if isinstance(module, nn.Linear) and leaf in FP8_WEIGHTS:
                q, s = quantize_fp8(module.weight)
                module.weight.copy_(dequantize_fp8(q, s, q.shape[1]))
                experts += leaf in ("w1", "w2", "w3")
            elif isinstance(getattr(module, "gate_up_proj", None), nn.Parameter):  # fused experts (E, 2I, H)
                for attr in ("gate_up_proj", "down_proj"):
                    p = getattr(module, attr)
                    p.copy_(dequantize_experts(*quantize_experts(p), None, torch.float32))
                    experts += p.shape[0] * (2 if attr == "gate_up_proj" else 1)
    return experts


def _logits(model: nn.Module, ids: list[int]) -> torch.Tensor:
    from lmserver.runner.accuracy import window_logits, window_runner

    return window_logits(window_runner(model, 64), ids)


def test_online_fp8_quantizes_the_experts_per_row(tmp_path: Path) -> None:
    hf, src = _hf_mixtral(tmp_path)
    config = read_model_config(src)
    model = load_model(config, src, dtype=torch.float32, max_positions=64, quantization="fp8")
    ref = load_model(config, src, dtype=torch.float32, max_positions=64)
    moes = {n: m for n, m in model.named_modules() if isinstance(m, MoE)}
    assert len(moes) == TINY["num_hidden_layers"]
    for name, moe in moes.items():
        assert moe.is_fp8 and moe.scale_block is None and moe.w13.dtype == FP8_DTYPE and moe.w2.dtype == FP8_DTYPE
        assert moe.w13_scale is not None and moe.w13_scale.shape == (4, 2 * TINY["intermediate_size"])
        assert moe.w2_scale is not None and moe.w2_scale.shape == (4, TINY["hidden_size"])
        assert type(moe.gate) is nn.Linear and moe.gate.weight.dtype == torch.float32  # the router stays
        base = ref.get_submodule(name)
        for w, s, full in ((moe.w13, moe.w13_scale, base.w13), (moe.w2, moe.w2_scale, base.w2)):
            q, scale = quantize_experts(full.data)
            assert torch.equal(w.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s, scale)
    assert all(isinstance(m.self_attn.qkv_proj, Fp8Linear) for m in model.model.layers)
    ids = list(range(3, 40))
    fp8_logits = _logits(model, ids)
    base_logits = _logits(ref, ids)
    assert float((fp8_logits - base_logits).norm() / base_logits.norm()) < 0.1  # FP8's error
    assert _fp8_twin_(hf) == TINY["num_hidden_layers"] * TINY["num_local_experts"] * 3
    with torch.no_grad():
        twin = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(fp8_logits, twin, rtol=0, atol=1e-4)  # exactly the dequantized weights' model


def test_online_fp8_mixtral_through_the_engine_is_greedy_as_its_dequantized_twin(tmp_path: Path) -> None:
    """The engine (scheduler, paged KV, chunked prefill, batching) on `--quantization fp8` of a tiny Mixtral: its
    greedy tokens are HF `generate`'s on the same model with every FP8 weight replaced by its dequantized value
    (test_online_fp8_quantizes_the_experts_per_row: those logits within FP8 error of the unquantized model's)."""
    from lmserver import Engine

    hf, src = _hf_mixtral(tmp_path, vocab_size=512, eos_token_id=2, bos_token_id=1)
    with torch.no_grad():  # larger weights than the default init, so greedy paths are not flat
        for p in hf.parameters():
            p.mul_(8.0)
    hf.save_pretrained(src)
    save_word_level_tokenizer(src, 512)
    prompts = [[5, 17, 300, 41, 9] * 4, [100 + i for i in range(13)]]
    engine = Engine(str(src), dtype="float32", quantization="fp8", max_total_tokens=256, chunked_prefill_size=16)
    try:
        assert engine.core.resolved_config.quantization == "fp8"
        outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 8, "temperature": 0,
                                                                   "ignore_eos": True})
    finally:
        engine.shutdown()
    assert isinstance(outs, list)
    assert _fp8_twin_(hf) == TINY["num_hidden_layers"] * TINY["num_local_experts"] * 3
    for ids, out in zip(prompts, outs, strict=True):
        seq = list(ids)
        with torch.no_grad():  # greedy by hand: HF's generate would suppress EOS under min_new_tokens
            for _ in range(8):
                seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
        assert out["output_ids"] == seq[len(ids):]


def _write_fp8_mixtral(src: Path, dst: Path, layout: str, drop: str | None = None,
                       keep_bf16: str | None = None, fp8_weights: tuple[str, ...] = FP8_WEIGHTS,
                       ) -> dict[str, torch.Tensor]:
    """`src`'s decoder weights (`FP8_WEIGHTS`) written to `dst` as FP8 in `layout` (fp8-tensor: HF quant_method fp8
    with per-tensor `weight_scale` and a static `input_scale`; fp8-block: `weight_scale_inv` per 32 x 32 block;
    ct-channel / ct-block: compressed-tensors `weight_scale` per channel (N, 1) / per 32 x 32 block); their
    dequantized values replace them in
    `src` (both folders hold the same model). Returns the dequantized expert weights by checkpoint name. `drop`: a
    tensor left out; `keep_bf16`: a weight left unquantized; `fp8_weights`: the kinds of weight written in FP8."""
    from safetensors.torch import load_file, save_file

    block = 32  # small blocks so the tiny layers hold several (the published size is 128)
    state = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if not name.endswith(".weight") or name.split(".")[-2] not in fp8_weights or name == keep_bf16:
            out[name] = t
            continue
        base = name.removesuffix(".weight")
        if layout in ("fp8-block", "ct-block"):
            q3, s3 = quantize_experts(t[None], (block, block))
            q, s = q3[0], s3[0]
            out[base + (".weight_scale_inv" if layout == "fp8-block" else ".weight_scale")] = s
            deq = dequantize_experts(q, s, (block, block), t.dtype)
        elif layout == "fp8-tensor":
            s = t.float().abs().max() / 448
            q = (t.float() / s).to(FP8_DTYPE)
            out[base + ".weight_scale"] = s.reshape(())
            out[base + ".input_scale"] = torch.ones(())  # static activation scales are read and ignored
            deq = (q.float() * s).to(t.dtype)
        else:  # ct-channel
            q, s = quantize_fp8(t)
            out[base + ".weight_scale"] = s  # (N, 1)
            deq = dequantize_fp8(q, s, t.shape[1]).to(t.dtype)
        out[name] = q
        state[name] = deq
        if ".experts." in name:
            experts[name] = deq
    if drop is not None:
        del out[drop]
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"))
    save_file(state, str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    channel = {"type": "float", "num_bits": 8, "strategy": "channel", "dynamic": False, "symmetric": True}
    blocks = {**channel, "strategy": "block", "block_structure": [block, block]}
    config["quantization_config"] = {
        "fp8-block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                      "weight_block_size": [block, block]},
        "fp8-tensor": {"quant_method": "fp8", "activation_scheme": "static"},
        "ct-channel": {"quant_method": "compressed-tensors", "format": "float-quantized",
                       "config_groups": {"group_0": {"targets": ["Linear"], "weights": channel}},
                       "ignore": ["lm_head", "re:.*block_sparse_moe.gate$"]},
        "ct-block": {"quant_method": "compressed-tensors", "format": "float-quantized",
                     "config_groups": {"group_0": {"targets": ["Linear"], "weights": blocks}},
                     "ignore": ["lm_head", "re:.*block_sparse_moe.gate$"]},
    }[layout]
    (dst / "config.json").write_text(json.dumps(config))
    return experts


@pytest.mark.parametrize("layout", ["fp8-tensor", "fp8-block", "ct-channel", "ct-block"])
def test_fp8_mixtral_checkpoint_loads_its_experts_as_written(tmp_path: Path, layout: str) -> None:
    from lmserver.models.mixtral import MixtralForCausalLM

    _, src = _hf_mixtral(tmp_path)
    dst = tmp_path / layout
    written = _write_fp8_mixtral(src, dst, layout)
    model = load_model(read_model_config(dst), dst, dtype=torch.float32, max_positions=64)
    block = (32, 32) if layout.endswith("block") else None
    inter = TINY["intermediate_size"]
    moes = {n: m for n, m in model.named_modules() if isinstance(m, MoE)}
    assert len(moes) == TINY["num_hidden_layers"]
    for name, moe in moes.items():
        assert moe.is_fp8 and moe.scale_block == block and type(moe.gate) is nn.Linear
        assert moe.w13_scale is not None and moe.w2_scale is not None
        d13 = dequantize_experts(moe.w13, moe.w13_scale, block, torch.float32)
        d2 = dequantize_experts(moe.w2, moe.w2_scale, block, torch.float32)
        prefix = name.replace(".mlp", ".block_sparse_moe.experts")
        for e in range(TINY["num_local_experts"]):
            assert torch.equal(d13[e, :inter], written[f"{prefix}.{e}.w1.weight"])
            assert torch.equal(d13[e, inter:], written[f"{prefix}.{e}.w3.weight"])
            assert torch.equal(d2[e], written[f"{prefix}.{e}.w2.weight"])
    assert isinstance(model, MixtralForCausalLM)
    twin = load_model(read_model_config(src), src, dtype=torch.float32, max_positions=64)
    ids = list(range(3, 40))
    torch.testing.assert_close(_logits(model, ids), _logits(twin, ids), rtol=0, atol=1e-4)


@pytest.mark.parametrize(("layout", "drop", "missing"), [
    ("fp8-block", "model.layers.1.block_sparse_moe.experts.2.w3.weight_scale_inv", r"layers\.1\.mlp\.w13"),
    ("fp8-tensor", "model.layers.0.block_sparse_moe.experts.0.w2.weight_scale", r"layers\.0\.mlp\.w2"),
])
def test_fp8_mixtral_checkpoint_without_expert_scales_is_refused(tmp_path: Path, layout: str, drop: str,
                                                                 missing: str) -> None:
    _, src = _hf_mixtral(tmp_path)
    dst = tmp_path / "broken"
    _write_fp8_mixtral(src, dst, layout, drop=drop)
    with pytest.raises(ModelLoadError, match=f"missing scale tensors.*{missing}"):
        load_model(read_model_config(dst), dst, dtype=torch.float32, max_positions=64)


def test_fp8_mixtral_checkpoint_refusals(tmp_path: Path) -> None:
    # one expert weight left unquantized among FP8 ones; block scales whose rows straddle w1 and w3 (inter 80 is no
    # multiple of the 32-row blocks)
    _, src = _hf_mixtral(tmp_path)
    dst = tmp_path / "mixed"
    _write_fp8_mixtral(src, dst, "ct-channel", keep_bf16="model.layers.0.block_sparse_moe.experts.1.w1.weight")
    with pytest.raises(ModelLoadError, match=r"experts\.1\.w1\.weight.*torch\.float32.*every expert weight"):
        load_model(read_model_config(dst), dst, dtype=torch.float32, max_positions=64)
    _, src = _hf_mixtral(tmp_path / "odd", intermediate_size=80)
    dst = tmp_path / "odd-block"
    _write_fp8_mixtral(src, dst, "fp8-block")
    with pytest.raises(ModelLoadError, match="multiple of the scale block's 32 rows"):
        load_model(read_model_config(dst), dst, dtype=torch.float32, max_positions=64)


def test_fp8_weight_estimate_counts_one_byte_per_expert_weight() -> None:
    from lmserver.models.config import ModelConfig
    from lmserver.runner.resolve import estimate_weight_bytes

    mc = ModelConfig.from_hf({"architectures": ["MixtralForCausalLM"], **TINY})
    h, i, e, layers = TINY["hidden_size"], TINY["intermediate_size"], TINY["num_local_experts"], 2
    saved = estimate_weight_bytes(mc, "bfloat16", 64) - estimate_weight_bytes(mc, "bfloat16", 64, quantization="fp8")
    experts = layers * e * 3 * h * i  # one byte less per expert weight, 4 more per expert row
    expert_rows = layers * e * (2 * i + h)
    qkv_o = layers * ((h + 2 * 2 * (h // 4)) * h + h * h)
    attn_rows = layers * ((h + 2 * 2 * (h // 4)) + h)
    assert saved == experts - 4 * expert_rows + qkv_o - 4 * attn_rows


def test_fp8_mixtral_checkpoint_with_only_the_experts_in_fp8(tmp_path: Path) -> None:
    # experts FP8, attention projections in the model dtype: only the experts become FP8
    _, src = _hf_mixtral(tmp_path)
    dst = tmp_path / "experts-only"
    _write_fp8_mixtral(src, dst, "fp8-block", fp8_weights=("w1", "w2", "w3"))
    model = load_model(read_model_config(dst), dst, dtype=torch.float32, max_positions=64)
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())
    assert all(m.is_fp8 and m.scale_block == (32, 32) for m in model.modules() if isinstance(m, MoE))
    twin = load_model(read_model_config(src), src, dtype=torch.float32, max_positions=64)
    ids = list(range(3, 40))
    torch.testing.assert_close(_logits(model, ids), _logits(twin, ids), rtol=0, atol=1e-4)


# --- GPU: the fused FP8 kernels in the model and in decode graphs -----------------------------------------


@pytest.mark.gpu
def test_fp8_mixtral_fused_kernels_match_the_dequantizing_torch_path_on_the_gpu(tmp_path: Path) -> None:
    # float32 model on CUDA: the fused FP8 MoE kernels (fp16 operands) against the torch path on the dequantized
    # experts (disable_fused_kernels), the same FP8 bytes and scales; a wiring error is of order 1. 32 tokens: 16
    # pairs per expert, the fp16-operand tiles (more take W8A8 there, whose oracle is test_fp8_moe_kernels.py's)
    _, src = _hf_mixtral(tmp_path)
    config = read_model_config(src)
    fused = load_model(config, src, dtype=torch.float32, device="cuda", max_positions=64, quantization="fp8")
    plain = load_model(config, src, dtype=torch.float32, device="cuda", max_positions=64, quantization="fp8",
                       disable_fused_kernels=True)
    moe = fused.get_submodule("model.layers.0.mlp")
    assert isinstance(moe, MoE) and moe.is_fp8 and moe.kernels is not None and moe.kernels.fused_moe is not None
    ids = list(range(3, 35))
    a, b = _logits(fused, ids), _logits(plain, ids)
    assert float((a - b).norm() / b.norm()) < 1e-2


@pytest.mark.gpu
def test_fp8_mixtral_engine_decodes_the_same_in_cuda_graphs_as_eagerly(tmp_path: Path) -> None:
    # --quantization fp8 on CUDA: decode steps replay CUDA graphs holding the fused FP8 MoE kernels (routing on the
    # device); the same kernels run eagerly with --disable-cuda-graph: the same greedy tokens (float32: the two runs'
    # other kernels may split their sums differently by batch size, by ~1e-6, far below the greedy margins)
    from lmserver import Engine

    hf, src = _hf_mixtral(tmp_path, vocab_size=512, eos_token_id=2, bos_token_id=1, hidden_size=256,
                          intermediate_size=512, num_attention_heads=8, num_key_value_heads=4)
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(8.0)
    hf.save_pretrained(src)
    save_word_level_tokenizer(src, 512)
    prompts = [[5, 17, 300, 41, 9] * 4, [100 + i for i in range(13)], [7, 8, 9]]
    outs = []
    for eager in (False, True):
        engine = Engine(str(src), dtype="float32", device="cuda", quantization="fp8", max_total_tokens=1024,
                        disable_cuda_graph=eager, cuda_graph_max_bs=4)
        try:
            got = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 16, "temperature": 0,
                                                                      "ignore_eos": True})
        finally:
            engine.shutdown()
        assert isinstance(got, list)
        outs.append([o["output_ids"] for o in got])
    assert outs[0] == outs[1]


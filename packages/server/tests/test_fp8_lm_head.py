"""The opt-in FP8 LM head (`--quantize-lm-head`, issue 33): the head an `Fp8Linear` with per-row scales, the embedding
untouched (tied heads untied); its logits within e4m3's error of the unquantized head (float64 oracle); greedy
decoding through the engine on the embedded model equal to the dequantized model's; a checkpoint's FP8 lm_head;
refusals before the server is ready; on a GPU the decode GEMV at LM-head shapes against the dequantized reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lmserver.config import ServerConfig
from lmserver.kernels.fp8_ref import FP8_DTYPE, fp8_linear_ref, quantize_fp8
from lmserver.layers.fp8_linear import Fp8Linear
from lmserver.models.config import ModelConfig
from lmserver.models.loader import ModelLoadError, load_model, read_model_config
from lmserver.runner.resolve import ConfigError, estimate_weight_bytes, resolve_config, resolve_fp8
from lmserver.testing.fp8 import dequantized_twin, greedy_by_full_prefills, write_fp8_layout_checkpoint
from lmserver.testing.tiny_llama import write_tiny_llama

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
E4M3_REL = 2.0**-4  # e4m3 keeps 3 mantissa bits: a normal value rounds within half an ulp, 2^-4 of itself
E4M3_SUB = 2.0**-10  # below 2^-6 (subnormals, step 2^-9) the rounding error is at most 2^-10, times the row's scale


def _tiny_folder(tmp_path: Path, tied: bool) -> Path:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, tie_word_embeddings=tied)).eval()
    with torch.no_grad():  # a head of rows of different magnitudes, so per-row scales differ
        model.lm_head.weight.mul_(torch.logspace(-1, 1, TINY["vocab_size"])[:, None])
    folder = tmp_path / ("tied" if tied else "untied")
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_quantize_lm_head_makes_the_head_fp8_per_row_and_leaves_the_embedding(tmp_path: Path, tied: bool,
                                                                               dtype: torch.dtype) -> None:
    src = _tiny_folder(tmp_path, tied)
    config = read_model_config(src)
    assert config.tie_word_embeddings is tied
    plain = load_model(config, src, dtype=dtype, max_positions=64, quantization="fp8")
    model = load_model(config, src, dtype=dtype, max_positions=64, quantization="fp8", quantize_lm_head=True)
    assert isinstance(plain.lm_head, nn.Linear)  # opt-in: --quantization fp8 alone keeps the head
    head = model.lm_head
    assert isinstance(head, Fp8Linear) and head.weight.dtype == FP8_DTYPE
    assert head.weight_scale.shape == (TINY["vocab_size"], 1) and head.group_k == TINY["hidden_size"]  # per row
    embed = model.model.embed_tokens.weight
    assert embed.dtype == dtype and torch.equal(embed, plain.model.embed_tokens.weight)  # the embedding untouched
    assert embed.untyped_storage().data_ptr() != head.weight.untyped_storage().data_ptr()
    source = plain.lm_head.weight  # the unquantized head (the embedding itself when tied)
    if tied:
        assert source is plain.model.embed_tokens.weight
    want_q, want_scale = quantize_fp8(source.float(), None)
    assert torch.equal(head.weight_scale, want_scale)
    assert torch.equal(head.weight.view(torch.uint8), want_q.view(torch.uint8))
    assert sum(isinstance(m, Fp8Linear) for m in model.modules()) == 4 * TINY["num_hidden_layers"] + 1


def _head_bound(h: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, y: torch.Tensor, dtype: torch.dtype,
                ) -> torch.Tensor:
    """A bound on |fp8 head(h) - h @ w.T| per logit, from e4m3's precision (float64): each weight within
    2^-4 of itself or 2^-10 x its row's scale; plus the float rounding of the computation in `dtype`
    (float32: K products and sums at 2^-24 each, twice for the dequantized weight; bfloat16: the dequantized
    weight and the output rounded to 8 bits, 2^-9 each, with float32 sums)."""
    ah, aw = h.double().abs(), w.double().abs()
    e4m3 = ah @ aw.T * E4M3_REL + ah.sum(-1, keepdim=True) * (scale.double().T * E4M3_SUB)
    k = h.shape[-1]
    if dtype == torch.float32:
        arith = (ah @ aw.T) * (1 + E4M3_REL) * (k + 2) * 2.0**-24
    else:
        arith = (ah @ aw.T) * (1 + E4M3_REL) * (2.0**-9 + k * 2.0**-24) + (y.double().abs() + e4m3) * 2.0**-8
    return e4m3 + arith


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_fp8_lm_head_logits_are_within_e4m3_error_of_the_unquantized_head(tmp_path: Path, dtype: torch.dtype) -> None:
    """compute_logits of the FP8 head (the torch path: dequantize, then the matmul in the model dtype) against
    h @ W.T in float64 on the same hidden rows; the bound is e4m3's worst case (tight enough that one row's scale
    taken from the wrong exponent, 2x off, breaks it)."""
    src = _tiny_folder(tmp_path, tied=False)
    config = read_model_config(src)
    plain = load_model(config, src, dtype=dtype, max_positions=64, quantization="fp8")
    model = load_model(config, src, dtype=dtype, max_positions=64, quantization="fp8", quantize_lm_head=True)
    head = model.lm_head
    assert isinstance(head, Fp8Linear)
    g = torch.Generator().manual_seed(3)
    h = (torch.randn(12, TINY["hidden_size"], generator=g) * torch.logspace(-2, 1, 12)[:, None]).to(dtype)
    w = plain.lm_head.weight.detach()
    exact = h.double() @ w.double().T  # (12, vocab)
    logits = model.compute_logits(h)
    assert logits.dtype == torch.float32 and logits.shape == (12, TINY["vocab_size"])
    err = (logits.double() - exact).abs()
    bound = _head_bound(h, w, head.weight_scale, logits, dtype)
    assert bool((err <= bound).all()), float((err / bound).max())
    assert float(err.max()) > 0  # the head is FP8: its logits are not the unquantized ones
    with torch.no_grad():  # one row's scale 2x off: beyond e4m3's error
        head.weight_scale[5] *= 2
    assert not bool(((model.compute_logits(h).double() - exact).abs() <= bound).all())


def test_fp8_lm_head_refused_without_fp8_weights_and_under_tensor_parallelism(tmp_path: Path) -> None:
    src = _tiny_folder(tmp_path, tied=True)
    mc = read_model_config(src)
    with pytest.raises(ConfigError, match=r"--quantize-lm-head.*--quantization fp8"):
        resolve_config(ServerConfig(device="cpu", quantize_lm_head=True), mc, str(src))
    rc = resolve_config(ServerConfig(device="cpu", quantization="fp8", quantize_lm_head=True), mc, str(src))
    assert rc.quantization == "fp8" and rc.quantize_lm_head
    with pytest.raises(ConfigError, match=r"FP8 LM head \(--quantize-lm-head\) with tp_size > 1"):
        resolve_fp8(ServerConfig(quantization="fp8", quantize_lm_head=True, tp_size=2), mc, "cpu", "float32")
    with pytest.raises(ModelLoadError, match="quantize_lm_head needs FP8 weights"):
        load_model(mc, src, dtype=torch.float32, max_positions=64, quantize_lm_head=True)

    from lmserver.runner.distributed.shard import TensorParallelError, shard_model_

    class TwoRanks:  # shard_model_ refuses before it reads anything else of the group
        size, rank = 2, 0

    model = load_model(mc, src, dtype=torch.float32, max_positions=64, quantization="fp8", quantize_lm_head=True)
    with pytest.raises(TensorParallelError, match="FP8 LM head"):
        shard_model_(model, mc, TwoRanks())  # type: ignore[arg-type]


def test_cli_option_and_weight_estimate() -> None:
    from lmserver.edge.cli import parse_config

    assert parse_config(["--quantization", "fp8", "--quantize-lm-head"]).quantize_lm_head is True
    assert parse_config([]).quantize_lm_head is False
    v, h = TINY["vocab_size"], TINY["hidden_size"]
    for tied in (True, False):
        mc = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], **TINY, "tie_word_embeddings": tied})
        fp8 = estimate_weight_bytes(mc, "bfloat16", 64, quantization="fp8")
        with_head = estimate_weight_bytes(mc, "bfloat16", 64, quantization="fp8", quantize_lm_head=True)
        # tied: an FP8 copy (one byte per weight, a float32 scale per row) next to the bf16 embedding; untied: the
        # bf16 head's two bytes per weight become one, plus the scales
        assert with_head - fp8 == (v * h + 4 * v if tied else -(v * h) + 4 * v)


# --- an FP8 checkpoint whose lm_head is FP8 -----------------------------------------------------------------------


def test_fp8_checkpoint_lm_head_loads_as_fp8_and_a_tied_one_is_refused(tmp_path: Path) -> None:
    from lmserver.runner.accuracy import window_logits, window_runner

    src = _tiny_folder(tmp_path, tied=False)
    dst = tmp_path / "ct"
    write_fp8_layout_checkpoint(src, dst, "ct-channel", lm_head=True, tie_word_embeddings=False)
    model = load_model(read_model_config(dst), dst, dtype=torch.float32, max_positions=64)
    assert isinstance(model.lm_head, Fp8Linear) and model.lm_head.weight_scale.shape == (TINY["vocab_size"], 1)
    again = load_model(read_model_config(dst), dst, dtype=torch.float32, max_positions=64, quantize_lm_head=True)
    assert torch.equal(again.lm_head.weight_scale, model.lm_head.weight_scale)  # FP8 already: kept as loaded
    twin = load_model(read_model_config(src), src, dtype=torch.float32, max_positions=64)
    ids = list(range(3, 40))
    torch.testing.assert_close(window_logits(window_runner(model, 64), ids), window_logits(window_runner(twin, 64), ids),
                               rtol=0, atol=1e-4)
    tied = tmp_path / "ct-tied"
    write_fp8_layout_checkpoint(_tiny_folder(tmp_path / "again", tied=False), tied, "ct-channel", lm_head=True,
                                tie_word_embeddings=True)
    with pytest.raises(ModelLoadError, match="lm_head.weight.*tie_word_embeddings"):
        load_model(read_model_config(tied), tied, dtype=torch.float32, max_positions=64)


def test_a_checkpoints_fp8_lm_head_is_counted_in_fp8_by_the_kv_budget(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # the loader serves a checkpoint's FP8 head as FP8 without --quantize-lm-head: the weight estimate that sizes the
    # KV pool before loading (CUDA) must count it so. Oracle: the bytes of the model as loaded
    from lmserver.models.quantization import checkpoint_lm_head_is_fp8
    from lmserver.runner.resolve import resolve_kv_tokens

    dst, plain = tmp_path / "ct-head", tmp_path / "ct"
    write_fp8_layout_checkpoint(_tiny_folder(tmp_path, tied=False), dst, "ct-channel", lm_head=True,
                                tie_word_embeddings=False)
    write_fp8_layout_checkpoint(_tiny_folder(tmp_path / "again", tied=False), plain, "ct-channel")
    assert checkpoint_lm_head_is_fp8(dst)
    assert not checkpoint_lm_head_is_fp8(plain) and not checkpoint_lm_head_is_fp8(tmp_path / "missing")
    mc = read_model_config(dst)
    model = load_model(mc, dst, dtype=torch.bfloat16, max_positions=64)
    loaded = sum(t.numel() * t.element_size() for t in {id(t): t for t in (*model.parameters(), *model.buffers())}
                 .values())
    assert estimate_weight_bytes(mc, "bfloat16", 64, quantization="fp8", quantize_lm_head=True) == loaded
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (70 * gib, 80 * gib))
    cfg = ServerConfig(mem_fraction_static=0.5, context_length=64, quantization="fp8")
    exact = resolve_kv_tokens(cfg, mc, "cuda", "bfloat16", loaded)
    assert resolve_kv_tokens(cfg, mc, "cuda", "bfloat16", 0, fp8_lm_head=True) == exact
    assert resolve_kv_tokens(cfg, mc, "cuda", "bfloat16", 0) < exact  # the head counted in bf16: fewer KV slots


# --- greedy decoding through the engine ---------------------------------------------------------------------------


def _assert_engine_greedy_is_the_twins(folder: Path | None, prompts: list[list[int]], new: int,
                                       **engine_config: Any) -> None:
    """`Engine(folder, quantization="fp8", quantize_lm_head=True, ...)`'s greedy tokens (paged KV, chunked prefill,
    batched decode) equal those of the dequantized twin decoded by full prefills on the CPU."""
    from lmserver import Engine
    from lmserver.models.default_model import default_model_path

    engine = Engine(None if folder is None else str(folder), quantization="fp8", quantize_lm_head=True,
                    max_total_tokens=256, chunked_prefill_size=8, **engine_config)
    try:
        assert engine.core.resolved_config.quantize_lm_head and isinstance(engine.core.model.lm_head, Fp8Linear)
        outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": new, "temperature": 0,
                                                                   "ignore_eos": True})
    finally:
        engine.shutdown()
    assert isinstance(outs, list)
    # the twin as the engine loads the model (FP8 weights and an FP8 LM head), then dense in float32
    twin, fp8 = dequantized_twin(default_model_path() if folder is None else folder, max(map(len, prompts)) + new,
                                 quantization="fp8", quantize_lm_head=True)
    assert "lm_head" in fp8 and isinstance(twin.lm_head, nn.Linear) and twin.lm_head.weight is not twin.model.embed_tokens.weight
    assert [out["output_ids"] for out in outs] == greedy_by_full_prefills(twin, prompts, new)


def _tiny_engine_folder(tmp_path: Path) -> Path:
    """A tiny tied Llama of 512 tokens with a word-level tokenizer (the engine needs one; the tests send ids), its
    weights scaled up so that greedy paths are not flat."""
    return write_tiny_llama(tmp_path / "tiny-engine", **{**TINY, "vocab_size": 512})


PROMPTS = [[5, 17, 300, 41, 9] * 4, [100 + i for i in range(13)], [7, 8, 9]]


def test_fp8_lm_head_greedy_through_the_engine_is_its_dequantized_twin(tmp_path: Path) -> None:
    _assert_engine_greedy_is_the_twins(_tiny_engine_folder(tmp_path), PROMPTS, 8, dtype="float32")


@pytest.mark.slow  # ~1 min on 2 busy cores (every CPU step dequantizes the FP8 weights); the tiny model's test above
def test_embedded_model_fp8_lm_head_greedy_through_the_engine_is_its_dequantized_twin() -> None:  # same oracle
    """The embedded SmolLM2 (a tied head: untied, FP8 per row; the embedding float32) through the engine."""
    _assert_engine_greedy_is_the_twins(None, [[1, 504, 3458, 282, 4649, 314],
                                              [9690, 30, 1041, 2122, 314, 1248, 28, 253, 3811, 17]], 6, dtype="float32")


@pytest.mark.gpu
def test_fp8_lm_head_greedy_in_cuda_graphs_is_its_dequantized_twin(tmp_path: Path) -> None:
    """On CUDA the decode graphs (up to 4 rows here) hold the FP8 head's GEMV, prefill rows its GEMV too (<= 16 rows):
    float32 activations, float32 sums, so the greedy tokens are the dequantized twin's (margins >> 1e-5)."""
    _assert_engine_greedy_is_the_twins(_tiny_engine_folder(tmp_path), PROMPTS, 16, dtype="float32", device="cuda",
                                       cuda_graph_max_bs=4)


# --- GPU: the decode GEMV at LM-head shapes -------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(128256, 4096), (32000, 4096), (49152, 576)], ids=["llama3", "mixtral", "smollm2"])
def test_fp8_lm_head_gemv_at_lm_head_shapes_matches_the_dequantized_reference(shape: tuple[int, int]) -> None:
    """Fp8Linear's CUDA path at the LM heads' shapes (vocab x hidden of Llama-3-8B, Mixtral, SmolLM2): the FP8 GEMV
    at 1, 8 and 16 rows (decode; the tile table's entry or its default rule), `_scaled_mm` above (per-token FP8 rows:
    the wider tolerance of test_fp8_kernels' CUDA test), against the dequantized weights in float64."""
    from lmserver.kernels.testing import rel_error

    n, k = shape
    g = torch.Generator().manual_seed(n + k)
    dense = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        dense.weight.copy_((torch.randn(n, k, generator=g) * torch.logspace(-1, 0.5, n)[:, None] * 0.02).cuda())
    head = Fp8Linear.from_linear(dense, None)
    head.use_path("triton")
    for m in (1, 8, 16, 40):
        x = (torch.randn(m, k, generator=g) * 3).cuda().bfloat16()
        expected = fp8_linear_ref(x, head.weight, head.weight_scale, head.group_k, None, compute_dtype=torch.float64)
        got = head(x)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        tol = 6e-2 if m > 16 and head.scaled_mm else 8e-3
        assert rel_error(got, expected) < tol, (m, head.scaled_mm, rel_error(got, expected))

"""The model layers on lmserver's fused kernels (add + RMSNorm, RoPE in place, SiLU-and-mul) vs
the plain torch path, on one model switched between the two paths (`use_kernels`).

- CPU: which path `load_model` takes and why; the fused wiring (in-place ops on views of the QKV
  output, the separate residual stream) run with the torch-native references behind the kernel
  interface, which must give bit-identical logits and KV pools for every model family.
- The real Triton kernels on a tiny random Llama: on CUDA (`gpu`) and on the CPU under
  TRITON_INTERPRET=1 (a child process: the variable must be set before triton is imported).
- `gpu`: a SmolLM2-135M-shape model with dummy weights, greedy tokens fused vs unfused.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from lmserver.forward.kv_pool import KVPool, make_req_to_token
from lmserver.kernels import KernelOps, native_kernels, select_kernels
from lmserver.kernels.testing import assert_interpreter_run_passed, kernel_devices, pytest_under_interpreter
from lmserver.models.config import ModelConfig
from lmserver.models.loader import load_model, select_layer_kernels
from lmserver.runner.attention.registry import default_registry
from lmserver.runner.model_runner import ModelRunner
from lmserver.scheduler import ForwardItem, ScheduleDecision

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = kernel_devices()

_BASE = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5,
)
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"architectures": ["LlamaForCausalLM"]},
    "llama3-rope": {"architectures": ["LlamaForCausalLM"], "tie_word_embeddings": True, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16, "rope_theta": 500000.0}},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"]},  # q/k/v bias
    "qwen3": {"architectures": ["Qwen3ForCausalLM"]},  # per-head q/k RMSNorm before RoPE
    "mixtral": {"architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2},
}
# SmolLM2-135M's shape (GQA group 3, head_dim 64, tied embeddings).
SMOLLM2 = dict(
    architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
    max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=100000.0,
)
PROMPTS = [[5, 17, 99, 3, 42, 8, 61, 7, 7, 120, 1, 33], [7, 7, 120, 1], [33] * 5]


def _model(hf: dict[str, Any], dtype: torch.dtype, device: str, max_positions: int = 128) -> torch.nn.Module:
    """Dummy weights with norm weights around 1 (not all 1) so every norm weight matters."""
    config = ModelConfig.from_hf(hf)
    model = load_model(config, None, load_format="dummy", dtype=dtype, device=device, max_positions=max_positions,
                       seed=5, disable_fused_kernels=True)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_((1 + 0.5 * torch.randn(p.shape, generator=g)).to(p.dtype))
            elif name.endswith("gate.weight"):  # MoE router: logits far enough apart that top-k is stable
                p.mul_(50)
    return model


def _runner(model: torch.nn.Module, backend: str, device: str) -> ModelRunner:
    """A runner with its own KV pool over `model` (which `_generate` switches between paths)."""
    c = model.config  # type: ignore[attr-defined]
    dtype = next(model.parameters()).dtype
    pool = KVPool(256, c.num_hidden_layers, c.num_key_value_heads, c.head_dim, dtype, device)
    for cache in (*pool.k_cache, *pool.v_cache):  # allocated uninitialized; zeroed to compare whole pools
        cache.zero_()
    table = make_req_to_token(4, 128, device)
    return ModelRunner(model, pool, table, default_registry().create(backend, pool, table), torch.device(device))


def _item(row: int, prefix: int, ids: list[int], slots: list[int], all_logits: bool = False) -> ForwardItem:
    n = len(ids)
    return ForwardItem(
        rid=f"r{row}", req_pool_idx=row, prefix_len=prefix, token_ids=ids, out_slots=slots[prefix : prefix + n],
        table_start=prefix, table_slots=slots[prefix : prefix + n],
        logit_offsets=list(range(n)) if all_logits else [n - 1], completes_prefill=True,
    )


def _generate(
    runner: ModelRunner, model: torch.nn.Module, kernels: KernelOps | None, steps: int,
    follow: list[list[int]] | None = None,
) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Chunked prefill of PROMPTS[0] (8 + rest, over a cached prefix), full prefills of the others,
    then batched decode steps: greedy, or feeding `follow`'s tokens (teacher forcing). Returns
    the logits of every forward (float32, CPU) and the sequences."""
    model.use_kernels(kernels)  # type: ignore[operator]
    seqs = [list(p) for p in PROMPTS]
    slots = [list(range(1 + 80 * i, 1 + 80 * i + len(p) + steps)) for i, p in enumerate(PROMPTS)]
    first = runner.forward(ScheduleDecision("extend", [_item(0, 0, seqs[0][:8], slots[0], True)]))
    last = runner.forward(ScheduleDecision(
        "extend", [_item(0, 8, seqs[0][8:], slots[0])] + [_item(i, 0, seqs[i], slots[i]) for i in (1, 2)]
    ))
    out = [first.float().cpu(), last.float().cpu()]
    for _ in range(steps):
        for i, (s, nxt) in enumerate(zip(seqs, out[-1][-3:].argmax(-1).tolist(), strict=True)):
            s.append(follow[i][len(s)] if follow is not None else nxt)
        step = runner.forward(ScheduleDecision("decode", [_item(i, len(s) - 1, [s[-1]], slots[i])
                                                          for i, s in enumerate(seqs)]))
        out.append(step.float().cpu())
    return out, seqs


# --- the choice, on CPU --------------------------------------------------------------------

def test_layer_kernels_are_chosen_once_at_build_torch_ops_off_cuda() -> None:
    kernels, reason = select_layer_kernels("cpu", torch.float32)
    assert kernels is None and "torch ops" in reason and "cpu" in reason
    assert select_layer_kernels("cuda", torch.float64)[0] is None  # a dtype the kernels do not take
    kernels, reason = select_layer_kernels("cuda", torch.bfloat16, disable_fused_kernels=True)
    assert kernels is None and "disabled" in reason
    model = _model(FAMILIES["llama"] | _BASE, torch.float32, "cpu")
    assert not model.model.fused and model.model.rope.cos_sin is None  # type: ignore[union-attr]
    model.use_kernels(native_kernels("test"))  # type: ignore[operator]
    layer = model.model.layers[0]  # type: ignore[union-attr, index]
    assert model.model.fused and layer.mlp.kernels is not None and layer.input_layernorm.kernels is not None  # type: ignore[union-attr]
    # [cos | sin] of the half frequencies: the table the RoPE kernel reads
    rotary = model.model.rotary  # type: ignore[union-attr]
    assert torch.equal(model.model.rope.cos_sin[:, :8], rotary.cos_cache[:, :8])  # type: ignore[union-attr, index]
    assert torch.equal(model.model.rope.cos_sin[:, 8:], rotary.sin_cache[:, 8:])  # type: ignore[union-attr, index]


def test_disable_fused_kernels_is_a_server_option() -> None:
    from lmserver.edge.cli import parse_config

    assert parse_config(["serve", "--disable-fused-kernels"]).disable_fused_kernels
    assert not parse_config([]).disable_fused_kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_path_norm_and_rope_are_hugging_face_bit_for_bit(dtype: torch.dtype) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    from lmserver.layers.norm import RMSNorm
    from lmserver.layers.rotary import RotaryEmbedding
    from lmserver.models.llama import RopeTables

    g = torch.Generator().manual_seed(4)
    ours, theirs = RMSNorm(96, 1e-5).to(dtype), LlamaRMSNorm(96, 1e-5).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(96, generator=g))
        theirs.weight.copy_(ours.weight)
        x, res = (torch.randn(5, 96, generator=g).to(dtype) for _ in range(2))
        assert torch.equal(ours(x), theirs(x))
        normed, summed = ours.add_forward(x.clone(), res.clone())
        assert torch.equal(summed, res + x) and torch.equal(normed, theirs(res + x))
    # RoPE of q and k heads together (cat, two muls, one add) vs HF's apply_rotary_pos_emb
    params = {"rope_type": "default", "rope_theta": 10000.0}
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=64)
    hf_rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    tables = RopeTables(RotaryEmbedding(16, 64, params))
    pos = torch.tensor([0, 3, 17, 63])
    qk = torch.randn(4, 6, 16, generator=g).to(dtype)
    cos, sin = hf_rotary(qk, pos[None])
    want, _ = apply_rotary_pos_emb(qk.transpose(0, 1)[None], qk.transpose(0, 1)[None], cos, sin)
    assert torch.equal(tables.rotate(pos, qk), want[0].transpose(0, 1))


# --- the fused wiring with the reference kernels: bit-identical to the torch path -----------

@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_wiring_with_reference_kernels_is_bit_identical(family: str, dtype: torch.dtype) -> None:
    # The references round exactly where the torch path does (HF's roundings), so any difference
    # is a wiring error: a missed in-place write, a wrong view or stride, a residual added twice.
    model = _model(FAMILIES[family] | _BASE, dtype, "cpu")
    torch_runner = _runner(model, "torch_native", "cpu")
    ref_runner = _runner(model, "torch_native", "cpu")
    want, want_seqs = _generate(torch_runner, model, None, 4)
    got, got_seqs = _generate(ref_runner, model, native_kernels("test"), 4)
    assert got_seqs == want_seqs
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    for got_pool, want_pool in ((ref_runner.kv_pool.k_cache, torch_runner.kv_pool.k_cache),
                                (ref_runner.kv_pool.v_cache, torch_runner.kv_pool.v_cache)):
        assert all(torch.equal(a, b) for a, b in zip(got_pool, want_pool, strict=True))


# --- the Triton kernels: tiny model on CUDA or under the interpreter ------------------------

def _tol(dtype: torch.dtype) -> float:
    # Logits here are below 1. float32: the kernels' sums, rsqrt and exp may differ from torch's
    # in the last bit (about 1e-7 relative; measured under the interpreter: at most 2.7e-7 on the
    # logits), so 1e-5 is a wide margin. Half precision: a flipped rounding of an activation
    # (2^-11 relative in fp16, 2^-8 in bf16) moves a logit by about its rounding step, at most
    # 2^-11 (fp16) or 2^-8 (bf16) below 1 (measured fp16: 4.9e-4); 1e-2 and 3e-2 bound a few of
    # those while a wiring error is of order 1.
    return {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}[dtype]


# The interpreter mishandles bf16 arithmetic (kernels/README.md): fp32 and fp16 on the CPU, and
# (its slowness) not every family in both. Mixtral runs the fused MoE kernels (`KernelOps.fused_moe`).
CASES = {"cpu": [("llama", torch.float32), ("llama", torch.float16), ("qwen3", torch.float16), ("mixtral", torch.float32)],
         "cuda": [(f, d) for f in ("llama", "qwen3", "mixtral") for d in (torch.float32, torch.bfloat16, torch.float16)]}


@pytest.mark.parametrize("device", DEVICES)
def test_triton_layers_match_the_torch_path(device: str) -> None:
    ops = select_kernels(device, prefer="triton", interpret=INTERPRET)
    steps = 2 if device == "cpu" else 16
    for family, dtype in CASES[device]:
        model = _model(FAMILIES[family] | _BASE, dtype, device)
        backend = "torch_native" if device == "cpu" else "triton"
        want, want_seqs = _generate(_runner(model, backend, device), model, None, steps)
        got, _ = _generate(_runner(model, backend, device), model, ops, steps, follow=want_seqs)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=_tol(dtype), rtol=0)
            if dtype == torch.float32:  # teacher-forced, the same argmax at every step: the same greedy tokens
                assert torch.equal(a[-3:].argmax(-1), b[-3:].argmax(-1))


@pytest.mark.skipif(INTERPRET, reason="this is the parent of the interpreter run")
def test_triton_layers_on_the_cpu_in_a_child_process() -> None:
    pytest.importorskip("triton")
    proc = pytest_under_interpreter(__file__)
    assert_interpreter_run_passed(proc)


# --- GPU: SmolLM2-135M shape ---------------------------------------------------------------

@pytest.mark.gpu
def test_smollm2_shape_greedy_tokens_fused_vs_unfused() -> None:
    ops, reason = select_layer_kernels("cuda", torch.float32)
    assert ops is not None, reason
    steps = 32
    # float32: greedy runs identical token for token (differences about 1e-6, margins far above)
    model = _model(SMOLLM2, torch.float32, "cuda", max_positions=256)
    ref32, seqs32 = _generate(_runner(model, "triton", "cuda"), model, None, steps)
    got, seqs = _generate(_runner(model, "triton", "cuda"), model, ops, steps)
    assert seqs == seqs32
    for a, b in zip(got, ref32, strict=True):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=0)
    # bfloat16 (the same weights, rounded), teacher-forced on the float32 run: the fused path must
    # be as accurate as the torch path against float32. Greedy tokens are not compared here: with
    # dummy weights many top-2 margins are within bf16 noise (as in test_cuda_graph.py).
    model = _model(SMOLLM2, torch.bfloat16, "cuda", max_positions=256)
    unfused, _ = _generate(_runner(model, "triton", "cuda"), model, None, steps, follow=seqs32)
    fused, _ = _generate(_runner(model, "triton", "cuda"), model, ops, steps, follow=seqs32)
    ref = torch.cat(ref32)
    err_fused, err_unfused = (float((torch.cat(x) - ref).norm() / ref.norm()) for x in (fused, unfused))
    assert err_fused <= 1.25 * err_unfused + 1e-3, (err_fused, err_unfused)

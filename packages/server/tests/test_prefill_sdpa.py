"""Fresh-prompt attention through torch's SDPA (`kernels.prefill_sdpa`): against the float64 extend reference on the
CPU (torch's own SDPA choice), and on a Hopper GPU through cuDNN inside the `triton` backend against `torch_native`."""

from __future__ import annotations

import os

import pytest
import torch

from lmserver.kernels import prefill_sdpa
from lmserver.kernels import reference as ref
from lmserver.kernels.testing import random_paged_batch, rel_error


def _packed_views(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v as the model hands them over: views of one (tokens, q + 2 kv widths) projection output."""
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    return (qkv[:, :heads * dim].view(-1, heads, dim), qkv[:, heads * dim:(heads + kv_heads) * dim].view(-1, kv_heads, dim),
            qkv[:, (heads + kv_heads) * dim:].view(-1, kv_heads, dim))


@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 4, 32), (8, 2, 128)], ids=lambda s: "x".join(map(str, s)))
def test_causal_prefill_matches_extend_reference(shape: tuple[int, int, int]) -> None:
    heads, kv_heads, dim = shape
    new = [37, 1, 130, 64]
    batch = random_paged_batch([0] * len(new), new, heads, kv_heads, dim, torch.float32, "cpu",
                               torch.Generator().manual_seed(sum(shape)))
    expected = ref.extend_attention_ref(batch.q, batch.k_extend, batch.v_extend, batch.k_cache, batch.v_cache,
                                        batch.req_to_token, batch.req_pool_indices, batch.prefix_lens,
                                        batch.extend_lens, batch.extend_start_loc, dim**-0.5)
    for q, k, v in ((batch.q, batch.k_extend, batch.v_extend), _packed_views(batch.q, batch.k_extend, batch.v_extend)):
        out = torch.full_like(batch.q, float("nan"))
        assert prefill_sdpa.causal_prefill(q, k, v, new, dim**-0.5, out, backend=None) is out
        assert rel_error(out, expected) < 1e-5
        made = prefill_sdpa.causal_prefill(q, k, v, new, dim**-0.5, backend=None)  # a tensor of its own
        assert made.shape == batch.q.shape and made.is_contiguous() and torch.equal(made, out)
        one = new[0]  # one request: SDPA's output as it is when already packed, else a packed copy
        alone = prefill_sdpa.causal_prefill(q[:one], k[:one], v[:one], [one], dim**-0.5, backend=None)
        assert alone.shape == (one, heads, dim) and alone.is_contiguous() and torch.equal(alone, out[:one])
    with pytest.raises(ValueError, match="extend_lens"):
        prefill_sdpa.causal_prefill(batch.q, batch.k_extend, batch.v_extend, new[:-1], dim**-0.5, out, backend=None)


def test_use_for_takes_only_fresh_long_prompts() -> None:
    long = prefill_sdpa.MIN_TOKENS
    assert prefill_sdpa.use_for([long, long + 1], [0, 0])
    assert prefill_sdpa.use_for([long], None)
    assert not prefill_sdpa.use_for([long, long - 1], [0, 0])  # one short prompt: the Triton kernel for all
    assert not prefill_sdpa.use_for([long, long], [0, 5])  # a cached prefix
    assert not prefill_sdpa.use_for([], [])
    assert not prefill_sdpa.use_for([long] * (prefill_sdpa.MAX_REQUESTS + 1), None)
    assert prefill_sdpa.use_for([long] * prefill_sdpa.MAX_REQUESTS, None)


def test_length_agnostic_plans_follow_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(prefill_sdpa.AVOID_RECOMPILE, raising=False)
    assert not prefill_sdpa.length_agnostic_plans()
    assert prefill_sdpa.AVOID_RECOMPILE not in os.environ  # read only
    monkeypatch.setenv(prefill_sdpa.AVOID_RECOMPILE, "1")
    assert prefill_sdpa.length_agnostic_plans()


def test_cudnn_is_not_claimed_off_hopper() -> None:
    assert not prefill_sdpa.cudnn_available(torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not prefill_sdpa.cudnn_available(torch.device("cuda")),
                    reason="needs a Hopper GPU with cuDNN")
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["bf16-kv", "fp8-kv"])
def test_triton_backend_runs_fresh_prompts_through_cudnn(kv_dtype: torch.dtype | None) -> None:
    from lmserver.runner.attention.testing import compare_backends
    from lmserver.runner.attention.torch_native import TorchNativeBackend
    from lmserver.runner.attention.triton_backend import TritonBackend, TritonCudnnPrefillBackend

    assert not TritonBackend.CUDNN_PREFILL  # opt-in: the default backend never takes cuDNN
    made: list[TritonBackend] = []

    class Counting(TritonCudnnPrefillBackend):
        sdpa_calls = 0

        def _cudnn_prefill(self, *args, **kwargs) -> torch.Tensor | None:  # type: ignore[no-untyped-def]
            took = super()._cudnn_prefill(*args, **kwargs)
            self.sdpa_calls += took is not None
            return took

    def make(pool, table):  # type: ignore[no-untyped-def]
        made.append(Counting(pool, table))
        return made[-1]

    # a fresh batch of two long prompts (cuDNN), then a chunk over a prefix next to a fresh prompt (Triton), decodes
    compare_backends(TorchNativeBackend, make, device="cuda", shape=(32, 8, 128), dtype=torch.bfloat16,
                     num_slots=20000, width=8192, chunks=[[2048, 3000, 0], [0, 5, 2048]], decode_steps=2,
                     tol=1.6e-2, kv_cache_dtype=kv_dtype)
    assert made[0].sdpa_calls == 2  # both layers of the first step, and no fallback


def test_cudnn_prefill_is_an_opt_in_backend() -> None:
    from lmserver.runner.attention.registry import default_registry
    from lmserver.runner.attention.triton_backend import TritonBackend, TritonCudnnPrefillBackend

    names = default_registry().names()
    assert "triton" in names and "triton_cudnn" in names
    assert not TritonBackend.CUDNN_PREFILL and TritonCudnnPrefillBackend.CUDNN_PREFILL
    assert TritonCudnnPrefillBackend.name == "triton_cudnn"

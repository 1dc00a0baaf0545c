"""GPTQ-style FP8 rounding: error-compensating rounding of weights onto the e4m3 grid with a
calibration Hessian (offline FP8; `--quantization fp8` online rounds to nearest).

Round to nearest (RTN, `lmserver.kernels.fp8_ref.quantize_fp8`) rounds each weight on its own. A
linear layer's output error on inputs X is (W - Q) X, so for a row w of W the loss is
(w - q) H (w - q)^T with H = X^T X over calibration inputs; GPTQ (Frantar et al., 2022) rounds the
columns one at a time and moves each column's rounding error onto the columns not yet rounded,
weighted by the inverse Hessian (the optimal update of the remaining weights for a quadratic loss),
so correlated input features absorb each other's errors. Here the grid is e4m3 with one scale per
output channel (absolute maximum / 448 of the original row, as RTN: the checkpoint layout of
compressed-tensors' `channel` strategy); columns go in descending order of H's diagonal (act order:
the highest-energy inputs are rounded while the most columns are left to absorb their error), in
blocks of 128 with the lazy batch update, Hessian dampened by 1% of its mean diagonal. Inputs a
layer never sees (zero diagonal) get zero weight, as in GPTQ.

The Hessian comes from calibration text that is not the evaluation text. `gptq_quantize_linears_`
collects it with forward pre-hooks while a caller-supplied `run` feeds the calibration windows
through the model (this module does not know the runner), then replaces the projections by
`Fp8Linear` in the same layout as online quantization; `sequential` quantizes decoder layer by
decoder layer, each layer's Hessians taken with the earlier layers already in FP8 (the inputs the
layer will see when served).

The LM head (`gptq_quantize_lm_head_`, optional): the same rounding with the Hessian of its input
(the final norm's output) over every calibration position whose logits a caller-supplied `run`
computes; per-row scales as `--quantize-lm-head`'s round to nearest (`quantize_lm_head_`), a tied
head untied. `write_fp8_checkpoint` writes it as the checkpoint's FP8 `lm_head` with
`tie_word_embeddings` false, the embedding left as the source stores it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmserver.kernels.fp8_ref import FP8_DTYPE, FP8_MAX, dequantize_fp8
from lmserver.layers.fp8_linear import Fp8Linear
from lmserver.models.quantization import QuantizationError

__all__ = [
    "GPTQ_BLOCK",
    "GPTQ_DAMP",
    "GptqReport",
    "HessianAccumulator",
    "calibrate_kv_scales",
    "gptq_fp8",
    "gptq_quantize_linears_",
    "gptq_quantize_lm_head_",
    "rtn_scale",
    "write_fp8_checkpoint",
]

GPTQ_BLOCK = 128  # columns per lazy batch update (as GPTQ; the result does not depend on it)
GPTQ_DAMP = 0.01  # dampening: this fraction of H's mean diagonal added to its diagonal
_MIN_SCALE = 1e-12


class HessianAccumulator:
    """H = sum over inputs x (K,) of x x^T, in float64, and the number of inputs."""

    def __init__(self, k: int, device: torch.device | str = "cpu") -> None:
        self.h = torch.zeros(k, k, dtype=torch.float64, device=device)
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        """Adds the rows of x (..., K). Mutates self."""
        x2 = x.detach().reshape(-1, self.h.shape[0]).to(torch.float64)
        self.h.addmm_(x2.T, x2)
        self.count += x2.shape[0]

    def mean(self) -> torch.Tensor:
        """H / count (the scale of H does not change GPTQ's result; this keeps it readable)."""
        return self.h / max(self.count, 1)


def rtn_scale(weight: torch.Tensor) -> torch.Tensor:
    """Per-channel scales (N, 1) float32: each row's absolute maximum / 448 (as `quantize_fp8`). Pure."""
    return (weight.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(_MIN_SCALE)


def _codes(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 codes of w / scale (float32 division, saturated at +-448, round to nearest even), as float64."""
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).to(torch.float64)


def gptq_fp8(weight: torch.Tensor, hessian: torch.Tensor, *, scale: torch.Tensor | None = None,
             block: int = GPTQ_BLOCK, damp: float = GPTQ_DAMP,
             act_order: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (N, K) and hessian (K, K) -> (float8_e4m3fn (N, K), scale (N, 1) float32) with
    weight ~ codes * scale, rounded column by column with GPTQ's error compensation (module
    docstring). `scale` None: per-channel absolute max / 448 of `weight`. On the weight's device:
    the Hessian's inverse in float64, the column loop in float32. Pure."""
    n, k = weight.shape
    if hessian.shape != (k, k):
        raise ValueError(f"hessian shape {tuple(hessian.shape)} does not fit a weight of {k} columns")
    s32 = rtn_scale(weight) if scale is None else scale.float().reshape(n, 1)
    w = weight.to(torch.float64).clone()
    h = hessian.to(device=w.device, dtype=torch.float64).clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    perm = torch.argsort(torch.diagonal(h), descending=True, stable=True) if act_order else None
    if perm is not None:
        w, h = w[:, perm], h[perm][:, perm]
    h += torch.eye(k, dtype=torch.float64, device=w.device) * (damp * torch.diagonal(h).mean())
    # upper Cholesky factor of H^-1 (float64): row i holds the update of columns i.. once columns < i are fixed
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).to(torch.float32)
    # NOTE: the column loop runs in float32 on W transposed (a column of W is a contiguous row), as GPTQ's
    # reference code computes in float32; the rounding itself is exact (`_codes`)
    wt = w.T.to(torch.float32).contiguous()  # (K, N)
    codes = torch.empty_like(wt)
    s_row = s32.reshape(1, n)
    threads = torch.get_num_threads()
    # NOTE: one thread: the loop's ops are small (a column of N values) and intra-op threading makes them
    # ~10x slower on a loaded CPU (measured, 3072 x 576: 1.95 s with 2 threads, 0.19 s with 1)
    torch.set_num_threads(1)
    try:
        _gptq_columns(wt, codes, hinv, s_row, block)
    finally:
        torch.set_num_threads(threads)
    codes = codes.T
    if perm is not None:
        codes = codes[:, torch.argsort(perm)]
    return codes.to(torch.float32).to(FP8_DTYPE).contiguous(), s32.contiguous()


def _gptq_columns(wt: torch.Tensor, codes: torch.Tensor, hinv: torch.Tensor, s_row: torch.Tensor,
                  block: int) -> None:
    """GPTQ's column loop on wt (K, N) (W transposed, float32, updated in place), writing the e4m3 codes
    of each column into `codes` (K, N). Mutates wt and codes."""
    k = wt.shape[0]
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1 = wt[i1:i2].clone()
        err1 = torch.empty_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = w1[i : i + 1]
            c = (col / s_row).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).to(torch.float32)
            codes[i1 + i] = c
            err = (col - c * s_row) / hinv1[i, i]
            w1[i:].addr_(hinv1[i, i:], err[0], alpha=-1.0)
            err1[i] = err
        wt[i2:] -= hinv[i1:i2, i2:].T @ err1


@dataclass(frozen=True)
class GptqReport:
    """Per layer: the calibration output error of GPTQ and of round to nearest, relative to the
    output's energy (trace((W - Q) H (W - Q)^T) / trace(W H W^T))."""

    name: str
    gptq: float
    rtn: float


def _relative_error(w: torch.Tensor, q: torch.Tensor, h: torch.Tensor) -> float:
    d = w.to(torch.float64) - q.to(torch.float64)
    w64 = w.to(torch.float64)
    return float(((d @ h) * d).sum() / ((w64 @ h) * w64).sum().clamp_min(1e-300))


def _decoder_layer_index(name: str) -> int | None:
    found = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    return int(found.group(1)) if found else None


def gptq_quantize_linears_(model: nn.Module, run: Callable[[], None], *, keep_layers: Collection[int] = (),
                           sequential: bool = True, act_order: bool = True,
                           damp: float = GPTQ_DAMP) -> list[GptqReport]:
    """Offline FP8 with GPTQ rounding: the decoder projections (`FP8_LINEAR_NAMES`, as online
    quantization; decoder layers in `keep_layers` stay unquantized) become per-channel `Fp8Linear`
    whose codes are rounded with the Hessian of their inputs while `run()` feeds the calibration
    text through `model`.

    `sequential` (GPTQ's order): `run()` must be ONE forward over all the calibration tokens (one
    batch); each projection is rounded when the forward reaches it, from the inputs it gets, and
    the forward goes on through the rounded weights, so every projection's Hessian sees the earlier
    ones in FP8 (as served). Else `run()` may make any number of forwards, all on the unquantized
    model, and the projections are rounded after it. Returns each projection's calibration error
    against round to nearest's. Mutates `model`."""
    from lmserver.models.quantization import FP8_LINEAR_NAMES

    config = getattr(model, "config", None)
    num_layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    kept = {i + num_layers if i < 0 else i for i in keep_layers}
    targets = {name: m for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and name.rpartition(".")[2] in FP8_LINEAR_NAMES
               and _decoder_layer_index(name) not in kept}
    acc = {name: HessianAccumulator(m.in_features, m.weight.device) for name, m in targets.items()}
    done: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    reports: list[GptqReport] = []

    def round_layer(name: str) -> None:
        linear = targets[name]
        if acc[name].count == 0:
            raise ValueError(f"the calibration run never reached {name}")
        w = linear.weight.data
        h = acc[name].mean()
        codes, scale = gptq_fp8(w, h, act_order=act_order, damp=damp)
        rtn = _codes(w, rtn_scale(w)) * rtn_scale(w).to(torch.float64)
        deq = dequantize_fp8(codes, scale, linear.in_features, torch.float64)
        reports.append(GptqReport(name, _relative_error(w, deq, h), _relative_error(w, rtn, h)))
        done[name] = codes, scale
        if sequential:  # the rest of this forward runs through the rounded weights
            linear.weight.data.copy_(deq.to(w.dtype))

    def hook(name: str) -> Callable[..., None]:
        def pre(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            if name in done:
                raise ValueError(f"sequential GPTQ: run() reached {name} twice; feed the calibration tokens as "
                                 "one forward (one batch)")
            acc[name].add(args[0])
            if sequential:
                round_layer(name)
        return pre

    hooks = [m.register_forward_pre_hook(hook(name)) for name, m in targets.items()]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in hooks:
            h.remove()
    if not sequential:
        for name in targets:
            round_layer(name)
    missing = [name for name in targets if name not in done]
    if missing:
        raise ValueError(f"the calibration run never reached {', '.join(missing[:4])}")
    for name, (codes, scale) in done.items():
        linear = targets[name]
        layer = Fp8Linear(linear.in_features, linear.out_features, linear.bias is not None, None,
                          linear.weight.dtype, linear.weight.device)
        layer.weight.data.copy_(codes)
        layer.weight_scale.copy_(scale)
        if linear.bias is not None:
            assert layer.bias is not None
            layer.bias.data.copy_(linear.bias.data)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, layer)
    return reports


def gptq_quantize_lm_head_(model: nn.Module, run: Callable[[], None], *, act_order: bool = True,
                           damp: float = GPTQ_DAMP) -> GptqReport:
    """Offline FP8 LM head with GPTQ rounding: `model.lm_head` (an `nn.Linear`, tied to the embedding or
    not) becomes a per-row `Fp8Linear` (RTN's scales: the layout of `quantize_lm_head_`) whose codes are
    rounded with the Hessian of its input over every row `run()` feeds it. `run()` may make any number of
    forwards and should compute the logits of every calibration position (e.g. `window_logits`; a forward
    that computes only the last position's logits gives one row per sequence); the head is rounded after
    it, so the forwards see the unrounded head (its input does not depend on it). A tied head is untied:
    the embedding keeps its parameter, values and dtype. Returns the head's calibration error against round
    to nearest's. Mutates `model`. Raises QuantizationError for a head that is FP8 already or not a linear
    layer, ValueError when `run()` never reached the head."""
    head = getattr(model, "lm_head", None)
    if isinstance(head, Fp8Linear):
        raise QuantizationError("the LM head is FP8 already; GPTQ rounds it from its unquantized weights")
    if not isinstance(head, nn.Linear):
        raise QuantizationError(f"the LM head of {type(model).__name__} is {type(head).__name__}, not a linear layer; "
                                "it cannot be FP8")
    acc = HessianAccumulator(head.in_features, head.weight.device)

    def pre(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        acc.add(args[0])

    hook = head.register_forward_pre_hook(pre)
    try:
        with torch.no_grad():
            run()
    finally:
        hook.remove()
    if acc.count == 0:
        raise ValueError("the calibration run never reached the LM head")
    w = head.weight.data  # (vocab, hidden); the embedding's own tensor when tied: read, never written
    h = acc.mean()
    codes, scale = gptq_fp8(w, h, act_order=act_order, damp=damp)
    rtn = _codes(w, rtn_scale(w)) * rtn_scale(w).to(torch.float64)
    deq = dequantize_fp8(codes, scale, head.in_features, torch.float64)
    report = GptqReport("lm_head", _relative_error(w, deq, h), _relative_error(w, rtn, h))
    layer = Fp8Linear(head.in_features, head.out_features, head.bias is not None, None, w.dtype, w.device)
    layer.weight.data.copy_(codes)
    layer.weight_scale.copy_(scale)
    if head.bias is not None:
        assert layer.bias is not None
        layer.bias.data.copy_(head.bias.data)
    # NOTE: a new module with its own tensors: model.lm_head no longer aliases the embedding
    model.lm_head = layer
    return report


KV_SCALE_HEADROOM = 4.0  # calibrated KV scales: the calibration absolute max maps to 448 / this


def calibrate_kv_scales(model: nn.Module, run: Callable[[], None], *, rotate_k: bool = True,
                        headroom: float = KV_SCALE_HEADROOM) -> dict[int, dict[str, float]]:
    """Per-layer FP8 KV-cache scales from calibration: each layer's K (in the Hadamard basis the
    FP8 cache stores it in, `rotate_k`) and V absolute maximum over what `run()` feeds through
    `model`, times `headroom`, / 448. With scale 1.0 a layer whose values are small stores many of
    them as e4m3 subnormals (below 2^-6: SmolLM2-135M's layer-0 V has an absolute max of 0.6 and
    42% of its values there), so a per-layer scale keeps their 3 mantissa bits; the headroom keeps
    unseen larger values from saturating. Also set on the model as `FP8_KV_SCALES_ATTR` (what
    `kv_cache_options` and `write_fp8_checkpoint` read). Mutates `model`."""
    from lmserver.forward.batch import AttentionLayer
    from lmserver.kernels.fp8_ref import hadamard
    from lmserver.models.quantization import FP8_KV_SCALES_ATTR

    amax: dict[int, list[float]] = {}

    def pre(module: nn.Module, args: tuple[Any, ...]) -> None:
        _q, k, v = args[0], args[1], args[2]
        if rotate_k:
            k = torch.matmul(k.float(), hadamard(k.shape[-1], torch.float32, k.device))
        entry = amax.setdefault(int(module.layer_id), [0.0, 0.0])  # type: ignore[arg-type]
        entry[0] = max(entry[0], float(k.abs().max()))
        entry[1] = max(entry[1], float(v.abs().max()))

    hooks = [m.register_forward_pre_hook(pre) for m in model.modules() if isinstance(m, AttentionLayer)]
    try:
        with torch.no_grad():
            run()
    finally:
        for hook in hooks:
            hook.remove()
    scales = {layer: {"k": max(k * headroom / FP8_MAX, _MIN_SCALE), "v": max(v * headroom / FP8_MAX, _MIN_SCALE)}
              for layer, (k, v) in sorted(amax.items())}
    setattr(model, FP8_KV_SCALES_ATTR, scales)
    return scales


def write_fp8_checkpoint(model: nn.Module, source: str | Path, destination: str | Path) -> Path:
    """Writes `model`'s FP8 layers (per-channel `Fp8Linear`, e.g. after `gptq_quantize_linears_`) as
    an llm-compressor style compressed-tensors checkpoint that `load_model` reads back: `source`'s
    tensors with each FP8 projection's shards (the checkpoint's q/k/v and gate/up tensors, mapped by
    the model's own `map_weight`) replaced by their float8_e4m3fn rows and a (rows, 1) float32
    `weight_scale`, one `model.safetensors`; `source`'s other files copied, its config.json given a
    `quantization_config` (`channel` strategy, dynamic per-token activations, as FP8_DYNAMIC); the
    model's FP8 KV scales (`calibrate_kv_scales`), if any, as `self_attn.k_scale` / `v_scale`. An FP8
    LM head (`gptq_quantize_lm_head_`, `quantize_lm_head_`) is written as the FP8 `lm_head.weight` with
    its scales like a projection; when `model`'s config ties it to the embedding, config.json gets
    `tie_word_embeddings` false (the loader refuses an FP8 head on a tied config) and the embedding is
    written as the source stores it. Returns the folder. Raises ValueError for a layer with group
    scales, and for a tied multimodal model whose source has no LM head tensor (its name unknown)."""
    import json
    import shutil

    from safetensors.torch import save_file

    from lmserver.models.loader import iter_safetensors
    from lmserver.models.quantization import fp8_linear_layers

    src, dst = Path(source), Path(destination)
    layers = fp8_linear_layers(model)
    for name, layer in layers.items():
        if layer.weight_scale.shape[1] != 1:
            raise ValueError(f"{name} has group scales; write_fp8_checkpoint writes per-channel scales only")
    map_weight: Any = model.map_weight
    # NOTE: a tied model's map_weight skips the source's lm_head tensor (if any): the FP8 head is written under
    # that name, or "lm_head.weight", and the config untied below
    untie = "lm_head" in layers and bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    head_name = "lm_head.weight"
    out: dict[str, torch.Tensor] = {}
    written: dict[str, int] = {}

    def put(name: str, module: str, fp8: Fp8Linear, rows: slice) -> None:
        out[name] = fp8.weight.data[rows].detach().cpu().contiguous()
        out[name.removesuffix(".weight") + ".weight_scale"] = fp8.weight_scale[rows].detach().cpu().contiguous()
        written[module] = written.get(module, 0) + (rows.stop - rows.start)

    source_names: list[str] = []
    for name, tensor in iter_safetensors(src):
        source_names.append(name)
        mapped = map_weight(name)
        if untie and mapped is None and name.endswith("lm_head.weight"):
            head_name = name
            continue
        module = mapped[0].removesuffix(".weight") if mapped is not None and mapped[0].endswith(".weight") else ""
        fp8 = layers.get(module)
        if fp8 is None:
            out[name] = tensor.contiguous()
            continue
        index = mapped[1] if mapped is not None else ()
        put(name, module, fp8, index[0] if index and isinstance(index[0], slice) else slice(0, fp8.out_features))
    config = json.loads((src / "config.json").read_text())
    if untie:
        if isinstance(config.get("text_config"), dict) and not any(n.endswith("lm_head.weight") for n in source_names):
            raise ValueError("the source of this tied multimodal model has no LM head tensor to name the FP8 head after")
        put(head_name, "lm_head", layers["lm_head"], slice(0, layers["lm_head"].out_features))
        config["tie_word_embeddings"] = False
        if isinstance(config.get("text_config"), dict):
            config["text_config"]["tie_word_embeddings"] = False
    from lmserver.models.quantization import FP8_KV_SCALES_ATTR

    kv_scales: dict[int, dict[str, float]] = getattr(model, FP8_KV_SCALES_ATTR, None) or {}
    for layer_id, entry in kv_scales.items():
        for which in ("k", "v"):
            if which in entry:
                out[f"model.layers.{layer_id}.self_attn.{which}_scale"] = torch.tensor(float(entry[which]))
    short = [n for n, layer in layers.items() if written.get(n, 0) != layer.out_features]
    if short:
        raise ValueError(f"the source checkpoint does not cover the FP8 layers {short[:4]}")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True, "dynamic": False},
            "input_activations": {"type": "float", "num_bits": 8, "strategy": "token", "symmetric": True,
                                  "dynamic": True},
        }},
        **({"kv_cache_scheme": {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False,
                                "symmetric": True}} if kv_scales else {}),
        "ignore": sorted({n.removesuffix(".weight") for n, t in out.items()
                          if n.endswith(".weight") and t.dim() == 2 and t.dtype != FP8_DTYPE}),
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst

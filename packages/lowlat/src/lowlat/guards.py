"""Guards: every reason a plugin cannot serve a server set-up, decided once before weights load."""

from __future__ import annotations

from lowlat.spec import PluginSpec, Requirements, ServerSetup


def requirement_failures(req: Requirements, setup: ServerSetup) -> tuple[str, ...]:
    """Every requirement ``setup`` fails (empty when all pass). Pure: reads, never mutates."""
    reasons: list[str] = []
    if req.vendor is not None and setup.vendor != req.vendor:
        reasons.append(f"needs vendor {req.vendor}, server runs on {setup.vendor}")
    if req.min_capability is not None or req.max_capability is not None:
        cap = setup.capability
        if cap is None:
            reasons.append("needs a compute capability, the device reports none")
        else:
            if req.min_capability is not None and cap < req.min_capability:
                reasons.append(f"needs compute capability >= {_cap(req.min_capability)}, device has {_cap(cap)}")
            if req.max_capability is not None and cap > req.max_capability:
                reasons.append(f"needs compute capability <= {_cap(req.max_capability)}, device has {_cap(cap)}")
    if req.amd_archs and setup.amd_arch not in req.amd_archs:
        reasons.append(f"needs AMD arch in {list(req.amd_archs)}, device is {setup.amd_arch}")
    if req.dtypes and setup.dtype not in req.dtypes:
        reasons.append(f"needs dtype in {list(req.dtypes)}, server uses {setup.dtype}")
    if req.kv_dtypes and setup.kv_dtype not in req.kv_dtypes:
        reasons.append(f"needs KV dtype in {list(req.kv_dtypes)}, server uses {setup.kv_dtype}")
    if req.tp_sizes and setup.tp_size not in req.tp_sizes:
        reasons.append(f"needs TP size in {list(req.tp_sizes)}, server uses {setup.tp_size}")
    for feature in sorted(req.needed_features - setup.features):
        reasons.append(f"needs server feature {feature!r}, which is off")
    for feature in sorted(req.forbidden_features & setup.features):
        reasons.append(f"cannot run with server feature {feature!r}")
    if req.max_context is not None and setup.max_context > req.max_context:
        reasons.append(f"supports context up to {req.max_context}, server allows {setup.max_context}")
    return tuple(reasons)


def spec_failures(spec: PluginSpec, setup: ServerSetup) -> tuple[str, ...]:
    """Every reason ``spec`` cannot serve ``setup``: architecture first, then requirements. Pure."""
    reasons: list[str] = []
    if setup.arch not in spec.archs:
        reasons.append(f"serves {list(spec.archs)}, model is {setup.arch}")
    reasons.extend(requirement_failures(spec.requirements, setup))
    return tuple(reasons)


def detect_setup(
    arch: str,
    dtype: str,
    kv_dtype: str | None = None,
    device: str = "cuda",
    tp_size: int = 1,
    features: frozenset[str] = frozenset(),
    max_context: int = 4096,
) -> ServerSetup:
    """A ``ServerSetup`` with vendor, capability and AMD arch read from torch for ``device``.

    NVIDIA vs AMD is decided from ``torch.version.hip`` (a ROCm torch also reports ``torch.cuda``).
    A ``cpu`` device (or no visible GPU) gives vendor ``cpu``. Reads device properties only.
    """
    import torch

    vendor, amd_arch = "cpu", None
    capability: tuple[int, int] | None = None
    if device.startswith("cuda") and torch.cuda.is_available():
        idx = torch.device(device).index or 0
        if getattr(torch.version, "hip", None):
            vendor = "amd"
            props = torch.cuda.get_device_properties(idx)
            amd_arch = str(getattr(props, "gcnArchName", "")).split(":")[0] or None
        else:
            vendor = "nvidia"
            major, minor = torch.cuda.get_device_capability(idx)
            capability = (major, minor)
    return ServerSetup(
        arch=arch,
        dtype=dtype,
        kv_dtype=kv_dtype or dtype,
        vendor=vendor,
        capability=capability,
        amd_arch=amd_arch,
        tp_size=tp_size,
        features=frozenset(features),
        max_context=max_context,
        device="cuda" if device.startswith("cuda") else "cpu",
    )


def _cap(cap: tuple[int, int]) -> str:
    return f"{cap[0]}.{cap[1]}"

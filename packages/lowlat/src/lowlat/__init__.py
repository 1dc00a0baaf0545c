"""Low-latency kernel plugin framework: register, guard, build and dispatch specialized decoder kernels.

Usable by any torch model runner. A runner creates a ``Session`` over a ``Registry`` and walks
the start-up stages (configure -> loaded -> check_model -> agree -> build -> memory_measured
-> kv_sized -> install -> warmup -> capture), then asks ``Session.select(step)`` per step.
``lowlat.reference`` holds the torch-native decoder layer every plugin is tested against.
"""

from lowlat.agree import Agreement, Group, TorchGroup, agree
from lowlat.build import BuildContext, Built
from lowlat.config import LowlatConfig
from lowlat.errors import (
    AgreementError,
    GraphPathMismatch,
    KernelError,
    LowlatError,
    PluginLoadError,
    RegistryError,
    ShapeError,
    StartupOrderError,
    Unsupported,
)
from lowlat.explain import explain, format_report, report
from lowlat.graphs import ORIGINAL, PLUGIN, PathRecorder
from lowlat.guards import detect_setup, requirement_failures, spec_failures
from lowlat.layer import ForwardMeta, KVCache, LayerShape, LayerWeights, quantize_layer_fp8, rope_inv_freq
from lowlat.moe import MoELayerWeights, MoEShape, quantize_moe_layer_fp8, reference_moe_decoder_layer
from lowlat.reference import reference_decoder_layer
from lowlat.registry import ENTRY_POINT_GROUP, Registry, current_registry, register, use_registry
from lowlat.session import Report, Session, Stage, Verdict
from lowlat.spec import (
    FP8_WEIGHTS,
    Coverage,
    NotCovered,
    PluginSpec,
    Requirements,
    ServerSetup,
    Step,
    StepKind,
)

__version__ = "0.1.0"

__all__ = [
    "ENTRY_POINT_GROUP",
    "FP8_WEIGHTS",
    "ORIGINAL",
    "PLUGIN",
    "Agreement",
    "AgreementError",
    "BuildContext",
    "Built",
    "Coverage",
    "ForwardMeta",
    "GraphPathMismatch",
    "Group",
    "KVCache",
    "KernelError",
    "LayerShape",
    "LayerWeights",
    "LowlatConfig",
    "LowlatError",
    "NotCovered",
    "PathRecorder",
    "PluginLoadError",
    "PluginSpec",
    "Registry",
    "RegistryError",
    "Report",
    "Requirements",
    "ServerSetup",
    "Session",
    "ShapeError",
    "Stage",
    "StartupOrderError",
    "Step",
    "StepKind",
    "TorchGroup",
    "Unsupported",
    "Verdict",
    "__version__",
    "agree",
    "current_registry",
    "detect_setup",
    "explain",
    "format_report",
    "reference_decoder_layer",
    "MoELayerWeights",
    "MoEShape",
    "reference_moe_decoder_layer",
    "register",
    "report",
    "requirement_failures",
    "quantize_layer_fp8",
    "quantize_moe_layer_fp8",
    "rope_inv_freq",
    "spec_failures",
    "use_registry",
]

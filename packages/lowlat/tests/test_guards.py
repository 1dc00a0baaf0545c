"""Guards: every failed requirement is reported at once; coverage answers per step."""

from __future__ import annotations

from lowlat import Coverage, Requirements, Step, StepKind, requirement_failures, spec_failures
from lowlat.guards import detect_setup
from lowlat.testing import fake_setup, fake_spec


def test_all_requirements_pass() -> None:
    req = Requirements(
        vendor="nvidia",
        min_capability=(9, 0),
        dtypes=("bfloat16",),
        kv_dtypes=("bfloat16",),
        tp_sizes=(1, 2),
        needed_features=frozenset({"cuda_graph"}),
        forbidden_features=frozenset({"lora"}),
        max_context=8192,
    )
    assert requirement_failures(req, fake_setup(features=frozenset({"cuda_graph"}))) == ()


def test_every_failing_requirement_is_listed() -> None:
    req = Requirements(
        vendor="nvidia",
        min_capability=(9, 0),
        max_capability=(9, 0),
        dtypes=("bfloat16",),
        kv_dtypes=("bfloat16",),
        tp_sizes=(1,),
        needed_features=frozenset({"cuda_graph"}),
        forbidden_features=frozenset({"lora", "spec"}),
        max_context=1024,
    )
    s = fake_setup(vendor="amd", capability=(8, 0), dtype="float16", kv_dtype="float8", tp_size=4,
              features=frozenset({"lora", "spec"}), max_context=4096, amd_arch="gfx942")
    reasons = requirement_failures(req, s)
    text = "\n".join(reasons)
    assert len(reasons) == 9, reasons
    for needle in ("vendor nvidia", ">= 9.0", "dtype in", "KV dtype", "TP size", "'cuda_graph'", "'lora'", "'spec'", "1024"):
        assert needle in text


def test_capability_range_and_amd_arch() -> None:
    req = Requirements(min_capability=(8, 0), max_capability=(9, 0))
    assert requirement_failures(req, fake_setup(capability=(8, 9))) == ()
    assert len(requirement_failures(req, fake_setup(capability=(10, 0)))) == 1
    assert len(requirement_failures(req, fake_setup(capability=None))) == 1
    amd = Requirements(vendor="amd", amd_archs=("gfx942",))
    assert requirement_failures(amd, fake_setup(vendor="amd", amd_arch="gfx942", capability=None)) == ()
    assert len(requirement_failures(amd, fake_setup(vendor="amd", amd_arch="gfx90a"))) == 1


def test_arch_mismatch_is_a_reason() -> None:
    reasons = spec_failures(fake_spec(), fake_setup(arch="MixtralForCausalLM"))
    assert reasons and "MixtralForCausalLM" in reasons[0]


def test_coverage_reasons() -> None:
    cov = Coverage(step_kinds=frozenset({StepKind.DECODE}), max_tokens=8, max_query_len=1, max_context=4096)
    assert cov.why_not(Step.decode(8, 100)) is None
    assert "tokens" in (cov.why_not(Step.decode(9)) or "")
    assert "extend" in (cov.why_not(Step(StepKind.EXTEND, 1, 5, 5)) or "")
    assert "context" in (cov.why_not(Step.decode(1, 5000)) or "")
    assert "query" in (Coverage(step_kinds=frozenset(StepKind), max_tokens=64).why_not(Step(StepKind.VERIFY, 2, 8, 4)) or "")


def test_coverage_intersection_and_table_roundtrip() -> None:
    a = Coverage(frozenset({StepKind.DECODE, StepKind.VERIFY}), 16, 4, None)
    b = Coverage(frozenset({StepKind.DECODE}), 8, 1, 2048)
    c = a.intersect(b)
    assert c == Coverage(frozenset({StepKind.DECODE}), 8, 1, 2048)
    assert Coverage.from_table(a.to_table()) == a


def test_detect_setup_on_cpu() -> None:
    s = detect_setup("LlamaForCausalLM", "float32", device="cpu")
    assert (s.vendor, s.capability, s.device, s.kv_dtype) == ("cpu", None, "cpu", "float32")

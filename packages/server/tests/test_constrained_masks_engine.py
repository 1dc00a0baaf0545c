"""The engine's two-phase masks on the embedded SmolLM2-135M-Instruct (CPU, float32): every
sampling of a constrained batch applies the mask prepared right after the forward's launch,
and that mask is the one of the grammar states at sampling time.

Batch: constrained (regex with forced text, JSON Schema, greedy and sampled) and unconstrained
requests together, jump-forward on (re-prefills ride along with decodes in mixed batches).
Oracles: at each `apply`, a fresh single-phase `BatchMasker` over the grammars as they are then;
the outputs of the same batch with the prepare step switched off (the path before the split).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from lmserver import Engine
from lmserver.engine.constrained import BatchMasker

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "maximum": 120},
                   "city": {"enum": ["Paris", "London", "Tokyo"]}},
    "required": ["name", "age", "city"],
}
PROMPTS = ["Call me at", "Describe a person as JSON:", "The capital of France is", "Is the sky blue? Answer:",
           "Describe a friend as JSON:", "Once upon a time"]


def _params() -> list[dict[str, Any]]:
    return [
        {"max_new_tokens": 24, "temperature": 0.0, "regex": r"\(\d{3}\) \d{3}-\d{4}"},
        {"max_new_tokens": 40, "temperature": 0.0, "json_schema": json.dumps(PERSON)},
        {"max_new_tokens": 12, "temperature": 0.0},
        {"max_new_tokens": 8, "temperature": 0.7, "sampling_seed": 5, "regex": r" (yes|no)\."},
        {"max_new_tokens": 40, "temperature": 0.9, "sampling_seed": 7, "json_schema": json.dumps(PERSON)},
        {"max_new_tokens": 16, "temperature": 0.8, "sampling_seed": 3},
    ]


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    eng = Engine(dtype="float32", max_total_tokens=4096, max_running_requests=8)
    yield eng
    eng.shutdown()


def _run(engine: Engine) -> list[tuple[list[int], str]]:
    engine.flush_cache()
    outs = engine.generate(PROMPTS, _params())
    assert isinstance(outs, list)
    return [(o["output_ids"], o["meta_info"]["finish_reason"]["type"]) for o in outs]


@pytest.mark.parametrize("min_tokens", ["auto", "4"])
def test_prepared_masks_are_those_of_the_states_at_sampling(engine: Engine, monkeypatch: pytest.MonkeyPatch,
                                                            min_tokens: str) -> None:
    """auto (1 on CPU): every jump is made after its token; 4: jumps are deferred to the next
    schedule() (made or declined there, before the forward whose masks are prepared)."""
    cd = engine.core.constrained
    monkeypatch.setattr(cd, "jump_forward_min_tokens", min_tokens)
    deferred: list[int] = []
    orig_run_deferred = cd._run_deferred

    def run_deferred(scheduler: Any) -> None:
        deferred.append(len(cd._deferred))
        orig_run_deferred(scheduler)

    monkeypatch.setattr(cd, "_run_deferred", run_deferred)
    masker = cd.masker
    applies: list[bool] = []  # per constrained sampling: was its mask prepared before
    orig_apply = masker.apply

    def checked(logits: torch.Tensor, grammars: Any) -> torch.Tensor:
        prepared = masker.pending
        ref = BatchMasker(masker.vocab_size).apply(logits.clone(), grammars)  # the states now
        out = orig_apply(logits, grammars)
        assert torch.equal(out, ref)
        applies.append(prepared)
        return out

    monkeypatch.setattr(masker, "apply", checked)
    used0, stale0, jumps0 = masker.num_prepared_used, masker.num_stale_rows, cd.stats["jump_forward_steps"]
    two_phase = _run(engine)
    assert applies and all(applies)
    assert masker.num_prepared_used - used0 == len(applies)
    assert masker.num_stale_rows == stale0
    assert cd.stats["jump_forward_steps"] > jumps0  # the JSON keys and the phone's " " / "-" are forced
    assert bool(deferred) == (min_tokens != "auto")
    assert masker.prepare_time_s > 0

    # the same batch with the prepare step off: every mask is filled at apply, same tokens
    monkeypatch.setattr(cd, "prepare_masks", lambda states, device: None)
    applies.clear()
    one_phase = _run(engine)
    assert applies and not any(applies)
    assert one_phase == two_phase
    assert not engine.core.has_work()
    engine.core.check_memory_invariant()

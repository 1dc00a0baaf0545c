"""select's three methods on fixed logprob tables, checked against hand-computed scores."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lmdsl as sgl
from lmdsl.choices import decide
from lmdsl.testing import MockBackend

CHOICES = ["organ", "organism", "antidisestablishmentarianism"]
# organ: 1 token; organism: organ|ism; the long word: anti|dis|establish|ment|arian|ism.
CONDITIONAL = {
    "organ": [-1.0],
    "organism": [-1.0, -0.1],
    "antidisestablishmentarianism": [-2.0, -0.05, -0.05, -0.05, -0.05, -0.05],
}
UNCONDITIONAL = {
    "organ": [-3.0],
    "organism": [-1.5, -0.1],
    "antidisestablishmentarianism": [-2.5, -0.05, -0.05, -0.05, -0.05, -0.05],
}


def test_each_method_picks_a_different_winner() -> None:
    cond = [CONDITIONAL[c] for c in CHOICES]
    uncond = [UNCONDITIONAL[c] for c in CHOICES]
    # means: -1.0, -0.55, -0.375 -> the long word
    tln = decide("token_length_normalized", CHOICES, cond)
    assert tln.decision == "antidisestablishmentarianism"
    assert tln.meta_info["normalized_prompt_logprobs"] == pytest.approx([-1.0, -0.55, -0.375])
    # first tokens tie at -1.0 (organ, organism); next position: organ padded with its mean -1.0 < -0.1
    assert decide("greedy_token_selection", CHOICES, cond).decision == "organism"
    # mean(cond - uncond): 2.0, 0.25, 0.0833 -> organ
    uln = decide("unconditional_likelihood_normalized", CHOICES, cond, uncond)
    assert uln.decision == "organ"
    assert uln.meta_info["normalized_unconditional_prompt_logprobs"] == pytest.approx([2.0, 0.25, 0.5 / 6])


@pytest.mark.parametrize(
    ("method", "winner"),
    [("token_length_normalized", "antidisestablishmentarianism"), ("greedy_token_selection", "organism"),
     ("unconditional_likelihood_normalized", "organ"), (sgl.greedy_token_selection, "organism"), (None, CHOICES[2])],
)
def test_select_primitive_uses_the_method(method: object, winner: str) -> None:
    backend = MockBackend(select_logprobs=CONDITIONAL, unconditional_logprobs=UNCONDITIONAL)

    @sgl.function
    def prog(s):
        s += "A word: " + sgl.select("w", CHOICES, choices_method=method)

    state = prog.run(backend=backend)
    assert state["w"] == winner
    assert state.text() == "A word: " + winner
    assert backend.calls_of("select")[0].prompt.text == "A word: "
    assert state.get_meta_info("w")["normalized_prompt_logprobs"] == pytest.approx([-1.0, -0.55, -0.375])


def test_gen_with_choices_is_a_select_and_bad_methods_are_rejected() -> None:
    backend = MockBackend(select_logprobs={"yes": [-0.1], "no": [-2.0]})

    @sgl.function
    def prog(s):
        s += "Ok? " + sgl.gen("a", choices=["no", "yes"])

    assert prog.run(backend=backend)["a"] == "yes"
    with pytest.raises(ValueError, match="choices_method"):
        sgl.select("x", ["a"], choices_method="best")


logprob_lists = st.lists(st.floats(-20, 0, allow_nan=False), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(st.lists(logprob_lists, min_size=1, max_size=5))
def test_methods_agree_with_a_naive_oracle(tables: list[list[float]]) -> None:
    choices = [f"c{i}" for i in range(len(tables))]
    means = [sum(t) / len(t) for t in tables]
    best = max(means)
    assert decide("token_length_normalized", choices, tables).decision == choices[means.index(best)]
    # greedy: lexicographic max over rows padded with their mean, first index on a full tie
    width = max(len(t) for t in tables)
    rows = [t + [sum(t) / len(t)] * (width - len(t)) for t in tables]
    expected = max(range(len(rows)), key=lambda i: (rows[i], -i))
    assert decide("greedy_token_selection", choices, tables).decision == choices[expected]
    zeros = [[0.0] * len(t) for t in tables]
    assert decide("unconditional_likelihood_normalized", choices, tables, zeros).decision == choices[means.index(best)]
    assert all(math.isfinite(m) for m in means)

"""The chat speculation splitter and the completion buffer helpers against naive constructions."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lmdsl as sgl
from lmdsl.config import LmdslConfig
from lmdsl.ir import SamplingParams
from lmdsl.spec import SpecTerm, consume_constant, find_first_stop, match_template

labels = st.sampled_from(["Name:", "\nAge:", "\nCity:", " and ", "; "])
values = st.text(alphabet="abcxyz 019", max_size=8)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(labels, values), min_size=1, max_size=4, unique_by=lambda t: t[0]))
def test_match_template_recovers_the_values_of_a_following_reply(parts: list[tuple[str, str]]) -> None:
    terms: list[SpecTerm] = []
    reply = ""
    for i, (label, value) in enumerate(parts):
        terms += [SpecTerm(text=label), SpecTerm(name=f"v{i}", params=SamplingParams(stop=()))]
        reply += label + value
    assert all(label not in value for label, value in parts)
    got = match_template(terms, reply)
    assert got is not None
    assert [got[2 * i + 1] for i in range(len(parts))] == [v for _, v in parts]


def test_match_template_rejects_and_stops() -> None:
    name, age = SpecTerm(name="n", params=SamplingParams(stop=("\n",))), SpecTerm(name="a", params=SamplingParams())
    terms = [SpecTerm(text="Name:"), name, SpecTerm(text="\nAge:"), age]
    assert match_template(terms, "Name: Al\nAge: 3") == {1: " Al", 3: " 3"}
    assert match_template(terms, "Alice, 3") is None  # first constant missing
    assert match_template(terms, "Name: Al") is None  # the constant after a gen never comes
    assert match_template(terms, "Name: Al\nBirth: 3") is None  # stop first, then the wrong constant
    assert match_template([SpecTerm(text="A:"), name], "A: x\ny") == {1: " x"}


def test_buffer_helpers() -> None:
    assert find_first_stop("ab\ncd.", ("." , "\n")) == 2
    assert find_first_stop("abc", ("x", "")) == -1
    assert consume_constant("\nAge: 30\n", "\nAge:") == " 30\n"
    assert consume_constant("\nAge: 30\n", "\nBirth:") == ""
    assert consume_constant("\n", "\nAge:") == ""


def test_config_and_sampling_params_validation() -> None:
    with pytest.raises(ValueError, match="max_workers"):
        LmdslConfig(max_workers=0)
    with pytest.raises(ValueError, match="default_select_method"):
        LmdslConfig(default_select_method="best")
    assert LmdslConfig().with_(chat_spec_max_tries=5).chat_spec_max_tries == 5
    params = SamplingParams.build(stop="x", stop_token_ids=[7], stop_regex=["a+", "b+"], min_new_tokens=2,
                                  json_schema={"type": "string"})
    assert params.to_native() == {"min_new_tokens": 2, "json_schema": '{"type": "string"}', "stop": ["x"],
                                  "stop_token_ids": [7], "stop_regex": ["a+", "b+"]}
    with pytest.raises(ValueError, match="num_api_spec_tokens"):
        sgl.function(num_api_spec_tokens=0)(lambda s: None)

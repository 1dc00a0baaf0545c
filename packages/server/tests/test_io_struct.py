"""The front-end/engine contract: sampling-parameter parsing and validation, n expansion."""

import pytest

from lmserver.io_struct import GenerateReq, InvalidRequestError, SamplingParams, expand_n


def test_defaults_follow_native_api() -> None:
    p = SamplingParams.from_dict({})
    assert (p.max_new_tokens, p.temperature, p.top_k, p.top_p, p.n) == (128, 1.0, -1, 1.0, 1)


def test_stop_string_becomes_list_and_logit_bias_keys_become_ints() -> None:
    p = SamplingParams.from_dict({"stop": "\n", "logit_bias": {"5": -100}})
    assert p.stop == ["\n"] and p.logit_bias == {5: -100.0}


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"max_new_tokens": "3"}, "max_new_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"n": 0}, "n"),
        ({"regex": "a", "json_schema": "{}"}, "at most one"),
        ({"bogus": 1}, "bogus"),
        ({"stop": [""]}, "stop"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_bad_values_name_the_field(bad: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams.from_dict(bad)


def test_vocab_range_checked() -> None:
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        SamplingParams.from_dict({"stop_token_ids": [10]}).validate(vocab_size=10)


def test_expand_n_gives_distinct_rids_and_seeds() -> None:
    req = GenerateReq("r", [1, 2], SamplingParams.from_dict({"n": 3, "sampling_seed": 7}))
    reqs = expand_n(req)
    assert [r.rid for r in reqs] == ["r-0", "r-1", "r-2"]
    assert [r.sampling_params.sampling_seed for r in reqs] == [7, 8, 9]
    assert all(r.sampling_params.n == 1 for r in reqs)

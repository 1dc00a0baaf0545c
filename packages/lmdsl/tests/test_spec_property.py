"""Property: API speculative execution gives the plain run's variables for any template, whether the
model follows it or not, with no more calls; with a self-consistent model that follows, one call."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

import lmdsl as sgl
from lmdsl.testing import MockBackend
from lmdsl.testing.fake_lm import CharMarkovLM

LABELS = ["Name", "Age", "City", "Job", "Pet", "Hobby"]
word = st.text(alphabet="abcdefghij", min_size=1, max_size=6)


@settings(max_examples=40, deadline=None)
@given(
    fields=st.lists(st.tuples(st.sampled_from(LABELS), st.lists(word, min_size=1, max_size=3)), min_size=1,
                    max_size=4, unique_by=lambda f: f[0]),
    diverge_at=st.integers(-1, 3),
    spec_tokens=st.integers(2, 64),
)
def test_speculative_equals_plain(fields: list[tuple[str, list[str]]], diverge_at: int, spec_tokens: int) -> None:
    preamble = "Person card.\n"
    model_labels = [label for label, _ in fields]
    follows = not (0 <= diverge_at < len(fields))
    if not follows:
        model_labels[diverge_at] = "Other"
    corpus = preamble + "".join(f"{label}: {' '.join(v)}\n" for label, (_, v) in zip(model_labels, fields, strict=True))
    lm = CharMarkovLM(corpus, order=12)

    def body(s):
        s += preamble
        for label, _ in fields:
            s += label + ":" + sgl.gen(label, max_tokens=8, stop="\n") + "\n"

    plain_backend = MockBackend(respond=lambda p, _: lm.continuation(p.text))
    spec_backend = MockBackend(respond=lambda p, _: lm.continuation(p.text))
    plain = sgl.function(body).run(backend=plain_backend)
    spec = sgl.function(num_api_spec_tokens=spec_tokens)(body).run(backend=spec_backend)
    assert plain.error() is None and spec.error() is None
    assert {k: spec[k] for k, _ in fields} == {k: plain[k] for k, _ in fields}
    assert spec.text() == plain.text()
    assert spec.usage().num_api_calls <= plain.usage().num_api_calls
    if follows and spec_tokens >= 64:
        assert spec.usage().num_api_calls == 1
        assert [" " + " ".join(v) for _, v in fields] == [spec[k] for k, _ in fields]

"""The vocabulary and token masks.

`vocab` (`Vocabulary` and its per-vocabulary tables), `index` (`Index`: a mask row per DFA
state, `build_index`), the token walks (`walker`, `walks`, `loops`, `state_classes`,
`templates`, `fragments`), `rows` (token sets to mask rows), `compressed` (jump-forward)."""

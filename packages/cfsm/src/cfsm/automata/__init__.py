"""Syntax tree to minimal byte DFA.

`automaton` (the generic construction: NFA, subset construction, minimization, `Dfa`),
`direct` (JSON-shaped trees straight to a minimal table) with its `blocks`, `block_facts`
and `direct_loops`."""

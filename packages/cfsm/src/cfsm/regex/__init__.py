"""The regex frontend and the syntax tree every frontend produces.

`syntax` (the tree: Chars, Cat, Alt, Repeat, Intersect, Complement, Shared, Sep), `parser`
(regex text to a tree), `charset` (code point range sets, Unicode classes, UTF-8 sequences)."""

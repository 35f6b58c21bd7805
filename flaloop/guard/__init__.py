"""The guard: every known way of faking a win, as named rules (static, over the diff) and probes
(dynamic, in the bench workers). Each produces `Finding`s; a blocking finding keeps a cell or a
run from any FASTER verdict. docs/GUARD.md has one section per rule and probe."""

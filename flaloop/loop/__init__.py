"""The optimization loop: baseline, iterations, statuses, stall, stop and no-go, dispatch, traps.

store.py       the records on disk (one JSON per iteration, decision, dispatch row); atomic writes
rules.py       every rule of the loop as a pure function of records (the rule book)
iteration.py   phase 1 (`baseline`) and one iteration (`iter`): gate, guard, bench, commit, revert
records.py     OPT_LOG.md and dispatch.md written above the user's notes; hand edits detected
               (report/opt_log.py draws them from the records)
condition.py   the dispatch bucket language (T<=512 and D==128), parsed, never eval'd
traps.py       TRAPS.md and flaloop's trap catalogue
header.py      the kept kernel's header comment
docs/LOOP.md describes the loop as a user meets it.
"""

"""How results look to a person: nothing here measures, every view is drawn from stored records.

cells.py     CellView: one bench cell as every table, comment and plot reads it
fmt.py       every formatter (ms, speedup, interval, geomean, share, tree state) and the colours
terminal.py  the terminal: gate results, run records (the bench table), findings; tables that fit
loop.py      the terminal: an iteration's verdict, the loop's status
opt_log.py   OPT_LOG.md and dispatch.md as drawn from the loop's records, and the loop's lines
sweep.py     a sweep's ranked table and sweep.md
build.py     `flaloop report`: the claim and its evidence, as a dict (report.json)
markdown.py  REPORT.md and the pull-request comments (a report's, a sweep's)
plots.py     the PNG plots (matplotlib, imported when one is drawn)
compare.py   two stored run records side by side (`flaloop compare`) and what counts as slower
"""

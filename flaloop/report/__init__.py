"""How results look: the terminal tables, the markdown report, the GitHub comment, compare, plots."""

"""`flaloop sanitize`: the flow, one tool run, and reading its log."""

"""What the tests share: repos made from real files, the CLI run as a user runs it, processes read
through /proc, and the sweep's candidates. Tests import `from support.<module> import ...`."""

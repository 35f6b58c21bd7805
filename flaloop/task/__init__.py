"""The task: the target repo, its contract, its op declarations and the frozen gate."""

"""Plain utilities every part uses: errors, processes, locks, files, git, the workspace, the clock."""

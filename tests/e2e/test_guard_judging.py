"""The audit on a real repo: a diff of comments, docstrings and layout is told from a change of code.
The session's judging over synthetic reports is in tests/unit/test_guard_judging.py."""

from __future__ import annotations


def test_the_audit_knows_a_diff_of_comments_docstrings_and_layout_from_a_change_of_code(tmp_path):
    import subprocess

    from flaloop.guard.audit import same_code
    from flaloop.guard.static import Change

    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)
    git("init", "-q")
    (tmp_path / "op.py").write_text('"""The op."""\n\ndef f(x):\n    """Doc."""\n    return x + 1\n')
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base")
    base = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    changed = [Change("op.py", "modified")]
    (tmp_path / "op.py").write_text('"""The op, reworded."""\n\n\ndef f(x):  # a comment\n    return (x\n            + 1)\n')
    assert same_code(tmp_path, base, changed)
    (tmp_path / "op.py").write_text('def f(x):\n    return x + 2\n')
    assert not same_code(tmp_path, base, changed)
    (tmp_path / "new.py").write_text("")
    assert not same_code(tmp_path, base, [Change("new.py", "untracked")])



"""Everything that runs inside the target's interpreter: the bench worker (`worker/`) and the step
scripts and pytest plugins (`scripts/`). Nothing here imports flaloop: flaloop runs these files by
path with the target's Python, and this module is the one place that says where they are."""

from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE / "worker"  # the bench worker's package, run as `python WORKER/__main__.py`
SCRIPTS = HERE / "scripts"  # step scripts and the gate's pytest plugins


def script(name: str) -> Path:
    """The step script or plugin `name` (a file name under scripts/)."""
    return SCRIPTS / name

"""What one session measured, raw: the cells' results and the story of the run (bench/session.py
makes it, bench/finish.py analyses it, a Ray node sends it back as `to_dict`)."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field, fields

from flaloop.bench.model import CellResult
from flaloop.guard.findings import Finding


@dataclass
class Measurement:
    """What one session measured, raw: per-cell results and the story of the run. Everything a
    record needs from the device's machine (a Ray node's too: it travels as `to_dict`)."""

    results: list[CellResult]
    hellos: list[dict] = field(default_factory=list)  # per measuring round: {side: hello}
    warmup_hellos: dict = field(default_factory=dict)
    warmup: dict = field(default_factory=dict)  # {side: pid} of the warm-up pair (it measures nothing)
    primed: dict | None = None  # when the warm-up compiled or tuned: k is calibrated afresh
    contested: list[str] = field(default_factory=list)  # cells given extra rounds
    restarts: int = 0
    errors: list[str] = field(default_factory=list)
    timeline: list[list] = field(default_factory=list)  # [what, seconds since the session began]
    waited: dict = field(default_factory=dict)  # seconds waited on each command (both sides at once: once)
    transfer: dict = field(default_factory=dict)  # how the base's results reached the candidate
    integrity: dict = field(default_factory=lambda: {"base": [], "cand": []})
    run_findings: list[Finding] = field(default_factory=list)  # guard findings about the whole run
    probe_seconds: float = 0.0
    unseen: dict | None = None  # the shapes nobody times, as checked in the warm-up (warmup.check_unseen)
    # timed calls checked against the base's (bench/timed.py): the rounds' input draw, how many, the seconds
    timed_calls: dict = field(default_factory=dict)
    test_calls: dict | None = None  # the test's own calls, replayed in the warm-up (replay.check_test_calls)
    lean_check: dict | None = None
    env: dict = field(default_factory=dict)  # fingerprint, idle evidence, how the workers started
    ceilings: dict | None = None  # the device's measured limits (roofline.Ceilings), taken where it ran
    ceilings_error: str | None = None
    interrupted: bool = False
    wall_s: float = 0.0
    host: str = field(default_factory=socket.gethostname)

    @property
    def started(self) -> bool:
        """Whether any worker answered (a session that failed before that leaves nothing to record)."""
        return bool(self.hellos or self.warmup_hellos or self.env)

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["results"] = [r.to_dict() for r in self.results]
        d["run_findings"] = [f.to_dict() for f in self.run_findings]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Measurement:
        names = {f.name for f in fields(cls)} - {"results", "run_findings"}
        out = cls(results=[CellResult.from_dict(r) for r in d.get("results") or []],
                  **{k: v for k, v in d.items() if k in names})
        out.run_findings = [Finding.from_dict(f) for f in d.get("run_findings") or []]
        return out

"""`bench()`: one paired session for the contract's op, and its run record.

The run record (`profile/<op>-opt/runs/<stamp>-{bench,aa}/record.json`) is the single source of
truth for everything printed or reported later: configuration, fingerprint, every raw pair,
per-cell estimates and verdicts, the guard's findings. It is written even when the run is cut
short (Ctrl-C), so that `--json` can name it.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import time
from dataclasses import asdict
from pathlib import Path

from flaloop import evidence, fsutil, git, roofline
from flaloop.bench.analysis import analyse
from flaloop.bench.model import BenchConfig, make_cells
from flaloop.bench.session import Cancelled, Events, Session
from flaloop.errors import MeasurementError, StorageError, UsageError
from flaloop.gate import last_gate_for
from flaloop.guard import dynamic
from flaloop.guard.audit import audit
from flaloop.guard.findings import apply_allowances

SCHEMA = 2


def write_record(run_dir: Path, record: dict) -> Path:
    return fsutil.atomic_write_json(run_dir / "record.json", record)


def now_stamp() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def _guard_summary(session: Session, static: dict | None, allowed: list[dict]) -> dict:
    cell_findings = [f for r in session.results for f in r.findings]
    findings = list(session.run_findings) + [f for f in (static or {}).get("findings", [])] + cell_findings
    return {"blocked": any(f.get("blocking") for f in findings), "findings": findings, "static": static,
            "integrity": session.integrity, "allowed": allowed, "probes": session.cfg.probes,
            "probe_seconds": round(session.probe_seconds, 3)}


def _roofline(record: dict, target, spec, env: dict, allowed: list[dict]) -> None:
    """Each cell's roofline floor and % of it (flaloop/roofline.py); a candidate faster than its
    floor is implausible: the cell is BLOCKED (unless the base is below it too: then the model,
    not the candidate, is wrong, and it is only a warning)."""
    try:
        ceilings = roofline.ceilings_for(target.python, env.get("device_uuid"))
    except MeasurementError as exc:
        ceilings = None
        record["errors"].append(f"roofline ceilings not measured: {exc.message}")
    roofline.annotate(record, ceilings, roofline.family_for(spec.registry, spec.name))
    if record["aa"]:
        return
    for cell in record["cells"]:
        roof, summ = cell.get("roofline") or {}, cell.get("summary") or {}
        f = dynamic.implausible(cell["cell"]["id"], (summ.get("cand") or {}).get("median"), roof.get("floor_ms"))
        if f is None:
            continue
        if (roof.get("pct_of_floor_base") or 0) > 100:
            f = dynamic.finding("implausible-speedup", f.message + " (the base is below it too: the model is "
                                     "off for this op)", f.cell, severity="warn")
        (f,) = apply_allowances([f], allowed)
        cell["findings"].append(f.to_dict())
        record["guard"]["findings"].append(f.to_dict())
        if f.blocking and cell.get("verdict") not in ("BLOCKED", None):
            cell["reason"] = (cell.get("reason") + "; " if cell.get("reason") else "") + \
                f"guard: implausible-speedup (measured {cell['verdict']})"
            cell["verdict"] = "BLOCKED"
            record["guard"]["blocked"] = True
    record["summary"]["n_blocked"] = sum(c.get("verdict") == "BLOCKED" for c in record["cells"])


def bench(target, contract, *, base_ref: str | None, shapes: list[str] | None, cfg: BenchConfig,
          on_event: Events | None = None, gate: dict | None = None, command: str = "",
          gpu: str | None = None, cancel=None) -> dict:
    """Run one paired session for the contract's op and keep its run record."""
    spec = target.op(contract.op)
    if not target.registry_file.is_file():
        raise UsageError(f"{contract.op} has no registry entry to build bench inputs from",
                         f"the bench reads TensorSpecs from {target.registry_file.relative_to(target.root)}")
    base_commit = git.resolve_ref(target.root, base_ref) if base_ref else contract.base_commit
    if git.file_at(target.root, base_commit, str(target.registry_file.relative_to(target.root))) is None:
        raise UsageError(f"the base {base_commit[:12]} has no {target.registry_file.relative_to(target.root)}",
                         "choose a base that has the registry (--base)")
    cells = make_cells(target.shape_configs(spec), shapes or contract.shapes, cfg.modes, cfg.dtype, cfg.varlen)
    if not cells:
        raise UsageError("no bench cells: no shapes selected", "pass --shapes or set shapes in the contract")
    cfg.overrides = {**contract.input_overrides, **cfg.overrides}
    allowed = list(getattr(contract, "allowed", None) or [])
    # The static rules over the diff against this run's base: seconds, before any process starts.
    static = None if cfg.aa else audit(target, contract, base_commit).to_dict()
    stamp = now_stamp()
    # its own directory, even when another run of this op started within the same second
    run_dir = fsutil.unique_dir(target.workspace(contract.op) / "runs", f"{stamp}-{'aa' if cfg.aa else 'bench'}")
    session = Session(root=target.root, python=target.python, op=contract.op,
                      registry_rel=str(target.registry_file.relative_to(target.root)), base_commit=base_commit,
                      cells=cells, config=cfg, run_dir=run_dir, on_event=on_event, allowed=allowed, gpu=gpu,
                      cancel=cancel)
    tree = git.tree_state(target.root)
    t0 = time.monotonic()
    interrupted = False
    pending: BaseException | None = None
    try:
        session.run()
    except (KeyboardInterrupt, Cancelled) as exc:
        interrupted, pending = True, exc
        raise
    finally:
        run_blocked = [f for f in session.run_findings + ((static or {}).get("findings") or []) if f.get("blocking")]
        summary = analyse(session.results, cfg.margin, cfg.seed, aa=cfg.aa, run_blocked=run_blocked)
        guard = _guard_summary(session, static, allowed)
        record = {
            "kind": "bench", "schema": SCHEMA, "op": contract.op, "created": stamp, "command": command,
            "aa": cfg.aa, "signal": cfg.signal, "base": {"ref": base_ref or contract.base_ref, "commit": base_commit},
            "candidate": {"tree": "base worktree (A/A)" if cfg.aa else str(target.root), **tree},
            "config": asdict(cfg), "env": session.env_info, "gpu": gpu,
            # where each side imported the op from: a measuring pair's word, or the warm-up pair's
            # when no cell got as far as a round (blocked, refused or failed in the warm-up)
            "workers": session.hellos[0] if session.hellos else session.warmup_hellos,
            "rounds": [{s: h.get("pid") for s, h in hs.items()} for hs in session.hellos],
            "import_s": [{s: h.get("import_s") for s, h in hs.items()} for hs in session.hellos],
            "warmup": session.warmup, "primed": session.primed, "contested": session.contested, "restarts": session.restarts,
            "gate": gate, "unverified": gate is None, "interrupted": interrupted,
            "last_gate": last_gate_for(target, contract.op, tree) if gate is None else None,
            "errors": session.errors, "wall_s": round(time.monotonic() - t0, 2), "timeline": session.timeline,
            "lean_check": session.lean_check, "waited_s": {k: round(v, 2) for k, v in session.waited.items()},
            "transfer": session.transfer,
            "guard": guard, "summary": summary, "cells": [r.to_dict() for r in session.results],
        }
        if not interrupted and session.env_info:
            record["env"]["during"] = evidence.during_evidence(evidence.readings_of(record))
            _roofline(record, target, spec, session.env_info, allowed)
        if session.pool is not None or interrupted:
            try:
                record["path"] = str(write_record(run_dir, record))
            except StorageError:
                if pending is None:
                    raise  # an interrupt outranks a record that could not be kept
        else:
            with contextlib.suppress(OSError):
                run_dir.rmdir()  # nothing ran (a bad worktree, say): no empty run directory left
        if pending is not None:  # so that `--json` can still name the record of a cut-short run
            pending.record_path = record.get("path")
    return record

"""The report as markdown, ready to paste into a pull request (FLA's PR body: summary, test plan,
benchmark, profile, conclusion and risk), from the dict `report.build()` returns."""

from __future__ import annotations

import os
from pathlib import Path

from flaloop.bench.evidence import contention_line
from flaloop.report import fmt
from flaloop.report.cells import CellView


def _headline(doc: dict) -> str:
    geo = doc["summary"]["geomean"]
    kind = doc["conclusion"]["kind"]
    if kind == "no-go" or not geo:
        return f"{doc['op']}: no-go"
    return f"{doc['op']}: {geo['speedup']:.3f}x geomean ({kind})"


def _device(env: dict) -> str:
    if env.get("device") == "cpu":
        return f"CPU ({env.get('device_name') or '?'}, no GPU)"
    return f"{env.get('device_name') or '?'} ({env.get('device_uuid') or 'no UUID'})"


def render(doc: dict, plots: dict[str, str] | None = None) -> str:
    L: list[str] = [f"# {_headline(doc)}", ""]
    L.append(f"_Rendered by `flaloop report {doc['op']}` on {doc['created']} from stored records; nothing "
             "was re-measured._")
    if doc["refused"]:
        L += ["", "> **REFUSED: this is not a claim of a win.**"]
        L += [f"> - `{r['reason']}`: {r['message']} ({r['hint']})" for r in doc["refused"]]
    L += ["", "## Summary", "", _summary(doc), ""]
    L += ["## Test plan", ""] + _test_plan(doc) + [""]
    L += ["## Benchmark", ""] + _benchmark(doc) + [""]
    L += ["## Reproduce", ""] + _reproduce(doc) + [""]
    L += ["## Environment", ""] + _environment(doc) + [""]
    L += ["## What explains the win", ""] + _explanation(doc) + [""]
    L += ["## Sanitizer", ""] + _sanitizer(doc) + [""]
    if doc.get("model"):
        L += ["## In the model", ""] + _in_model(doc, plots) + [""]
    L += ["## Profile", ""] + _profile(doc) + [""]
    L += ["## Guard", ""] + _guard(doc) + [""]
    L += ["## Conclusion and risk", "", f"**{doc['conclusion']['text']}**", ""]
    L += [f"- {r}" for r in doc["risks"]] or ["- none noted"]
    L.append("")
    if doc["trajectory"]:
        L += ["## Trajectory (OPT_LOG)", ""] + _trajectory(doc) + [""]
    if plots:
        L += ["## Plots", "", "_The images are the PNG files beside this file: pasted into a pull request, attach "
              "them (drag them into the comment box) and they show; `flaloop report --no-plots` renders this "
              "page without them._", ""] + [f"![{name}]({Path(p).name})" for name, p in plots.items()] + [""]
    return "\n".join(L)


# -- GitHub pull-request comments (`flaloop report --format github`) ----------------------------------

GITHUB_MARKER = "<!-- flaloop-report -->"  # a workflow finds (and updates) its own comment by it


def _gh_cells(cells: list[dict]) -> list[str]:
    """Cells (report rows, or a sweep row's cells: id, verdict, speedup, interval; status and reason when
    not measured)."""
    views = map(CellView.from_dict, cells)
    rows = [[f"`{v.id}`", fmt.verdict_md(v.verdict, v.status), fmt.speedup(v.speedup), fmt.interval(v.ci_low, v.ci_high)]
            for v in views]
    return fmt.table(["cell", "verdict", "speedup", "95% CI"], rows)


def _gh_findings(findings: list[dict]) -> list[str]:
    if not findings:
        return ["Guard: no findings."]
    return ["Guard findings:", ""] + fmt.table(["rule", "severity", "where", "what"], [
        [f"`{f.get('rule')}`", f.get("severity") or "", f.get("where") or "", (f.get("message") or "")[:300]]
        for f in findings])



def render_github(doc: dict) -> str:
    """The report (`report.build()`'s dict) as a pull-request comment: a headline, the op's cells in a
    collapsible block with the geomean and the guard's findings, and the marker."""
    s, geo = doc["summary"], doc["summary"]["geomean"]
    L = [GITHUB_MARKER, f"### flaloop: {_headline(doc)}", ""]
    if doc["refused"]:
        L += ["> **REFUSED: this is not a claim of a win.**"] + [f"> - `{r['reason']}`: {r['message']}" for r in doc["refused"]]
        L.append("")
    counts = ", ".join(f"{s[f'n_{v.lower()}']} {v}" for v in ("FASTER", "SLOWER", "SAME", "UNSURE"))
    L += ["<details><summary><b>" + doc["op"] + "</b>: " + doc["conclusion"]["text"] + f" ({counts})</summary>", ""]
    L += _gh_cells(doc["cells"]) + [""]
    if geo:
        L.append(f"Geomean over {s['n_measured']} cell(s): **{fmt.geomean(geo)}**, worst cell `{geo.get('worst_cell_id')}` "
                 f"{fmt.speedup(geo['worst_speedup'])}. Measured on {_device(doc['environment'])}.")
    L += ["", _test_plan(doc)[0]]  # the gate the claim stands on: green, red, a -k subset, or none
    L += [""] + _gh_findings(doc["guard"]["findings"]) + ["", "</details>", ""]
    L.append(f"_From stored records by `flaloop report {doc['op']} --format github`; nothing was re-measured._")
    return "\n".join(L) + "\n"


def render_github_sweep(rec, findings: dict[str, list[dict]] | None = None) -> str:
    """A sweep record (sweep/record.SweepRecord) as a pull-request comment: a headline, the ranked
    table, then one collapsible block per op (or candidate) with its cells, geomean, gate and the
    guard's findings (`findings`: per row key, read from its run record), and the marker."""
    findings = findings or {}
    name = (lambda r: r.op) if rec.kind == "ops" else (lambda r: r.ref)
    verdicts = [r.verdict or r.status.upper() for r in rec.rows]
    tally = ", ".join(f"{verdicts.count(v)} {v}" for v in dict.fromkeys(verdicts)) or "nothing measured"
    what = "op(s) the change touches" if rec.kind == "ops" else f"candidate(s) of {rec.ops[0]}"
    base = f"`{rec.base.commit[:12]}`" + (f" (`{rec.base.ref}`)" if rec.base.ref and rec.base.ref != rec.base.commit else "")
    bad = [r for r in rec.rows if r.status == "blocked" or r.slower or r.verdict == "SLOWER"]
    L = [GITHUB_MARKER, f"### flaloop: {len(rec.rows)} {what} against {base}: {tally}", ""]
    if bad:
        L += ["**" + ", ".join(f"{name(r)} {'BLOCKED' if r.status == 'blocked' else 'SLOWER'}" for r in bad) + "**", ""]
    L += fmt.table(["rank", "op" if rec.kind == "ops" else "candidate", "status", "verdict", "geomean (95% CI)",
                 "worst cell", "gate"],
                [[str(r.rank or "-"), name(r), r.status, r.verdict or "-", fmt.geomean(r.geomean),
                  f"{r.worst_cell['id']} {fmt.speedup(r.worst_cell['speedup'])}" if r.worst_cell else "-",
                  "-" if r.gate is None else ("green" if r.gate.get("green") else "RED")] for r in rec.rows]) + [""]
    for r in rec.rows:
        L += [f"<details><summary><b>{name(r)}</b>: {r.status}, {r.verdict or '-'}, geomean {fmt.geomean(r.geomean)}"
              "</summary>", ""]
        if r.reason:
            L += [f"{r.reason}", ""]
        if r.cells:
            L += _gh_cells(r.cells) + [""]
        if r.slower:
            L += ["SLOWER beyond the margin: " + ", ".join(f"`{c}`" for c in r.slower), ""]
        if r.gate is not None:
            c = r.gate.get("counts") or {}
            L += [f"Gate: {'green' if r.gate.get('green') else 'RED'} ({c.get('passed', '?')} passed, "
                  f"{c.get('failed', '?')} failed, {c.get('skipped', '?')} skipped)"
                  + (", reused" if r.gate.get("reused_from") else "") + ".", ""]
        rules = (r.guard or {}).get("rules") or []
        got = findings.get(r.key)
        if got is not None:
            L += _gh_findings(got) + [""]
        elif rules:
            L += ["Guard blocked: " + ", ".join(f"`{x}`" for x in rules), ""]
        L += [f"Commit `{(r.commit or '-')[:12]}`; {r.host or '?'}" + (f", GPU {r.gpu}" if r.gpu is not None else "")
              + f"; {r.wall_s:.0f} s.", "", "</details>", ""]
    L.append(f"_Margin ±{rec.margin:.1%}; `{rec.command or 'flaloop sweep'}`; rendered from `sweep.json` by "
             "`flaloop report --sweep DIR --format github`._")
    return "\n".join(L) + "\n"


def _summary(doc: dict) -> str:
    s, env, claim = doc["summary"], doc["environment"], doc["claim"]
    geo = s["geomean"]
    parts = [doc["conclusion"]["text"] + "."]
    parts.append(f"{s['n_measured']}/{s['n_cells']} cells measured on {_device(env)}: {s['n_faster']} FASTER, "
                 f"{s['n_same']} SAME, {s['n_slower']} SLOWER, {s['n_unsure']} UNSURE.")
    if geo:
        parts.append(f"Worst cell {geo.get('worst_cell_id')} at {fmt.speedup(geo['worst_speedup'])}.")
    if (s.get("target_speedup") or 1.0) > 1.0:
        parts.append(f"Contract target {s['target_speedup']:g}x: {'met' if s['target_met'] else 'not met'}.")
    where = f"iteration {claim['iteration']} ({claim['direction']!r})" if claim["source"] == "loop" else "the working tree"
    parts.append(f"Claim: {where}, commit `{str(claim['commit'])[:12]}`.")
    return " ".join(parts)


def _test_plan(doc: dict) -> list[str]:
    tp = doc["test_plan"]
    g = tp["gate"]
    if not g:
        out = [f"- Gate: **none recorded** for the measured tree state (`{tp['command']}`)"]
    else:
        c = g.get("counts") or {}
        scope = f"a -k subset ({g['k_expr']!r}), signal only" if g["signal_only"] else "the full file"
        state = "GREEN" if g["green"] else "RED"
        out = [f"- Gate: **{state}**, {c.get('passed', '?')} passed of {scope} `{g.get('test_file') or tp['test_file']}` "
               f"({c.get('selected', '?')} selected, {c.get('skipped', '?')} skipped, {c.get('failed', '?')} failed, "
               f"{c.get('errors', '?')} errors), from {g['source']}"]
        out += [f"  - {m}" for m in g.get("findings") or []]
    out.append(f"- Command: `{tp['command']}` (pytest on the unmodified file, in a subprocess)")
    if tp["frozen"]:
        out.append("- Frozen (hashed at the base): " + ", ".join(f"`{p}`" for p in tp["frozen"]))
    out.append("- Bench cells: outputs and gradients of candidate and base compared on every cell before timing")
    return out


def _benchmark(doc: dict) -> list[str]:
    views, env = [CellView.from_dict(r) for r in doc["cells"]], doc["environment"]
    out = [f"Hardware: {_device(env)}; bench command `{doc['commands']['bench']}`.", ""]
    header = ["cell", "timer", "base ms", "cand ms", "speedup", "95% CI", "verdict", "pairs", "launch-bound",
              "% of floor base -> cand", "bound"]
    body = []
    for v in views:
        roof = v.floor
        floor = (f"{fmt.pct(roof.get('pct_of_floor_base'))} -> {fmt.pct(roof.get('pct_of_floor_cand'))}"
                 + (" **ABOVE 100%**" if roof.get("above_100") else "")) if roof.get("floor_ms") else "no model" \
            if not roof else "no ceilings"
        body.append([v.id, v.timer or "-", fmt.ms(v.ms("base")), fmt.ms(v.ms("cand")), fmt.speedup(v.speedup),
                     fmt.interval(v.ci_low, v.ci_high, none="[-, -]"), v.verdict or v.status, v.n_pairs or "-",
                     "yes" if v.launch_bound else "no", floor, roof.get("bound") or "-"])
    out += ["### Speedup per cell (device time)", ""] + fmt.table(header, body) + [""]
    for title, key in (("Device time per call (ms)", "device"), ("Eager latency per call (ms, host in the loop)", "eager")):
        stat_rows = []
        for v in views:
            for side in ("base", "cand"):
                s = getattr(v, key)[side]
                if s:
                    stat_rows.append([v.id, side] + [fmt.num(s.get(k)) for k in ("median", "mean", "std", "min", "p10", "p90")]
                                     + [s.get("n", "-")])
        if stat_rows:
            out += [f"### {title}", ""] + fmt.table(["cell", "side", "median", "mean", "std", "min", "p10", "p90", "n"],
                                                    stat_rows) + [""]
    geo = doc["summary"]["geomean"]
    if geo:
        out.append(f"**Geomean speedup** (equal weight over {doc['summary']['n_measured']} cells): "
                   f"**{fmt.speedup(geo['speedup'])}**, 95% CI {fmt.interval(geo['ci_low'], geo['ci_high'])}; worst cell "
                   f"{geo.get('worst_cell_id')} {fmt.speedup(geo['worst_speedup'])}; {geo['n_regressions']} regression(s).")
    cov = doc["coverage"]
    kinds = " + ".join(k for k in ("dense", "varlen") if cov[k]) or "none"
    out.append(f"Coverage: {kinds}: {len(cov['dense'])} dense cell(s), {len(cov['varlen'])} varlen cell(s) "
               f"({', '.join(cov['varlen']) or 'none'}); modes {', '.join(cov['modes'])}"
               + ("." if cov.get("l2", ["rotate"]) == ["rotate"] else
                  f"; L2 as each timed call starts: {', '.join(cov['l2'])} (docs/COMMANDS.md: \"Cold and hot L2\")."))
    roof = doc["roofline"]
    if roof["family"]:
        c = roof["ceilings"]
        ceil = (f"{c['bandwidth_gbs']:.4g} GB/s copy, {c['peak_tflops']:.4g} TFLOP/s {c['gemm_dtype']} GEMM "
                f"(measured {c.get('measured') or '?'})") if c else "no ceilings cached for this device"
        out.append(f"Roofline: {roof['title']} model (docs/ROOFLINE.md); ceilings {ceil}.")
    else:
        out.append("Roofline: no model for this op.")
    aa = doc["aa"]
    if aa and aa.get("geomean"):
        g = aa["geomean"]
        out.append(f"A/A self-check of this base ({aa['created']}): {fmt.speedup(g['speedup'])}, 95% CI "
                   f"{fmt.interval(g['ci_low'], g['ci_high'])} (`{aa['command']}`).")
    return out


def _rel(doc: dict, path: str | None) -> str | None:
    """A path as the repository names it (a pull request has no /home/you)."""
    root = doc.get("repo")
    if not path or not root:
        return path
    rel = os.path.relpath(path, root)
    return path if rel.startswith("..") else rel


def _reproduce(doc: dict) -> list[str]:
    m, rep = doc["commits"], doc["reproduce"]
    cand = m["candidate"]
    out = ["In a checkout of the measured code, " + f"`{rep['commit']}` "
           f"(e.g. `git worktree add ../claim {rep['commit'][:12]}`):", "", "```sh", *rep["commands"], "```", ""]
    out.append(f"- Base: `{m['base_commit']}`" + (f" (`{m['base_ref']}`)" if m["base_ref"] not in (None, m["base_commit"]) else ""))
    dirty = f" + uncommitted diff `{cand['diff_hash']}`" if cand.get("dirty") else ""
    out.append(f"- Candidate: `{cand.get('head')}`{dirty}; claim commit `{m['claim_commit']}`")
    out.append(f"- Run record: `{_rel(doc, doc['records']['claim'])}`"
               + (f" (newer interrupted or partial records not used: "
                  f"{', '.join(f'`{_rel(doc, p)}`' for p in doc['records']['skipped'])})"
                  if doc["records"].get("skipped") else ""))
    if doc["commands"].get("bench"):
        out.append(f"- The measurement was taken by `{doc['commands']['bench']}`")
    return out


def _clock_line(label: str, ev: dict) -> str:
    if not ev or not ev.get("available"):
        return f"- {label}: {(ev or {}).get('reason') or 'not recorded'}"
    sm = ev.get("sm_mhz") or {}
    parts = [f"SM {sm.get('min')}-{sm.get('max')} MHz of {ev.get('sm_max_mhz')}"]
    mem = ev.get("mem_mhz") or {}
    if mem:
        parts.append(f"memory {mem.get('min')}-{mem.get('max')} MHz")
    t, p = ev.get("temperature_c") or {}, ev.get("power_w") or {}
    if t:
        parts.append(f"{t.get('min')}-{t.get('max')} C")
    if p:
        parts.append(f"{p.get('min'):.0f}-{p.get('max'):.0f} W")
    parts.append("throttle: " + (", ".join(ev.get("throttle_reasons") or []) or "none"))
    if "other_processes" in ev:
        others = ev.get("other_processes") or []
        parts.append(f"{len(others)} other process(es) on the GPU")
    if "idle" in ev:
        why = "; ".join(ev.get("not_idle_because") or [])
        parts.append("IDLE" if ev["idle"] else f"idle unknown: {why}" if ev["idle"] is None else f"NOT IDLE: {why}")
    if "n_readings" in ev:
        parts.append(f"{ev['n_readings']} readings")
    return f"- {label}: " + ", ".join(parts)


def _environment(doc: dict) -> list[str]:
    env = doc["environment"]
    keys = [("GPU / device", _device(env)), ("driver", env.get("driver")), ("CUDA", env.get("cuda")),
            ("PyTorch", env.get("torch")), ("Triton", env.get("triton")), ("TileLang", env.get("tilelang")),
            ("CuTe DSL", env.get("cutlass")), ("Python", env.get("python")), ("host", env.get("host")),
            ("CUDA_VISIBLE_DEVICES", env.get("cuda_visible_devices"))]
    out = fmt.table(["", ""], [[k, v] for k, v in keys if v]) + [""]
    out.append(_clock_line("Idle before measuring", env.get("idle") or {}))
    out.append(_clock_line("During the pairs", env.get("during") or {}))
    shared = contention_line(env.get("contention"))
    if shared:
        out.append(f"- Sharing: {shared}")
    elif (env.get("contention") or {}).get("state") == "exclusive":
        c = env["contention"]
        out.append(f"- Sharing: no other process on the GPU after any of the {c['observed']} pairs")
    return out


def _explanation(doc: dict) -> list[str]:
    e = doc.get("explanation")
    if not e:
        return [f"No explanation of the claimed tree state: `{doc['commands']['explain']}` (and `flaloop stop OP "
                "--go` takes one)."]
    return [f"From `{_rel(doc, e.get('_path'))}`.", ""] + explanation_md(e).splitlines()




def explanation_md(e: dict, top: int = 8) -> str:
    """The explanation (explain.account's document) as markdown: the shares, then per cell the
    kernels that moved most, base and candidate device time and launches per step."""
    lo, hi = e["bounds"]["share"]
    rounds = (f", in {e['rounds']} rounds with the sides back to back ({', '.join(e.get('order') or [])})"
              if (e.get("rounds") or 1) > 1 else "")
    L = [f"Every measured cell profiled over {e.get('steps')} steps on both sides{rounds} ({e.get('kernels_are')}). "
         f"The share is the part of the bench's measured saving that the kernels' own saving (plus the launches "
         f"saved, at the bench's time per launch beyond the kernels) accounts for; on a cell that won (its CI above 1 + margin) and over all "
         f"of them it must not lie wholly outside [{lo:.0%}, {hi:.0%}] (below: the win is not in the kernels; "
         f"above: the profiled step is not what the bench timed).", ""]
    rows = []
    for c in e["cells"]:
        share = c.get("share")
        rows.append([f"`{c['id']}`", c.get("verdict") or "-", fmt.ms(c.get("base_ms")), fmt.ms(c.get("cand_ms")),
                     fmt.ms(c.get("kernel_base_ms")), fmt.ms(c.get("kernel_cand_ms")),
                     f"{fmt.launches(c.get('launches_base'))} -> {fmt.launches(c.get('launches_cand'))}",
                     "-" if share is None else f"{share:.0%} [{c['share_low']:.0%}, {c['share_high']:.0%}]",
                     "**unexplained**" if c.get("finding") else ("checked" if c.get("checked") else "-")])
    L += fmt.table(["cell", "verdict", "bench base ms", "bench cand ms", "kernels base ms", "kernels cand ms",
                 "launches", "share explained", ""], rows)
    t = e.get("total")
    if t:
        L += ["", f"Over the cells that won: the kernels account for {t['share']:.0%} "
                  f"[{t['share_low']:.0%}, {t['share_high']:.0%}] of {t['saved_ms']:.4f} ms saved."]
    for c in e["cells"]:
        ks = [k for k in c["kernels"] if abs(k["delta_ms"]) > 0 or k["change"] != "kept"][:top]
        if not ks:
            continue
        L += ["", f"`{c['id']}`:", ""]
        L += fmt.table(["kernel", "base ms", "cand ms", "delta ms", "launches", "change"], [
            [f"`{k['name'][:70]}`", fmt.ms(k["base_ms"]), fmt.ms(k["cand_ms"]), f"{k['delta_ms']:+.4f}",
             f"{fmt.launches(k['base_launches'])} -> {fmt.launches(k['cand_launches'])}", k["change"]] for k in ks])
    if e.get("findings"):
        L += ["", "**`unexplained-speedup` blocks the go:**", ""]
        L += [f"- {f.get('cell') or 'all cells'}: {f['message']}" for f in e["findings"]]
    if e.get("unsure"):
        L += ["", "**Unsure (not refused):**", ""] + [f"- {u}" for u in e["unsure"]]
    if e.get("not_profiled"):
        L += ["", "Not profiled: " + ", ".join(f"`{x}`" for x in e["not_profiled"]) + "."]
    return "\n".join(L)


def _sanitizer(doc: dict) -> list[str]:
    """The compute-sanitizer run of the kept commit (sanitize.json): per tool, both sides' errors,
    status and seconds; then what only the candidate has, and what could not be checked."""
    z = doc.get("sanitizer")
    if not z:
        cmd = (doc.get("commands") or {}).get("sanitize") or f"flaloop sanitize {doc['op']}"
        return [f"No compute-sanitizer run of the claimed commit: `{cmd}` (and `flaloop "
                "stop OP --go` runs one)."]
    tools = z.get("tools") or {}
    if tools and not any(e.get("available") for e in tools.values()):
        reasons = sorted({str(e.get("reason")) for e in tools.values()})
        return [f"compute-sanitizer checked nothing (`{_rel(doc, z.get('path'))}`): {'; '.join(reasons)}. On a machine "
                f"with the CUDA toolkit: `{(doc.get('commands') or {}).get('sanitize') or 'flaloop sanitize OP'}`."]
    ver = "compute-sanitizer " + str((z.get("sanitizer") or {}).get("version") or "?").removeprefix("Version ").split(" (")[0]
    out = [f"From `{_rel(doc, z.get('path'))}` ({ver}): one step of {len(z.get('cells') or [])} cell(s) under each "
           f"tool, on the base and on the kept commit, in {fmt.num(z.get('wall_s'), '.1f')} s.", ""]
    rows = []
    for tool, e in tools.items():
        sides = e.get("sides") or {}

        def side(name: str, key: str, sides=sides):
            v = (sides.get(name) or {}).get(key)
            return "-" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)
        status = "unavailable: " + str(e.get("reason")) if not e.get("available") else \
            ("**new errors**" if e.get("new") else "clean" if not e.get("pre_existing") else "pre-existing only")
        rows.append([tool, side("base", "errors"), side("cand", "errors"), status, side("base", "wall_s"),
                     side("cand", "wall_s")])
    out += fmt.table(["tool", "errors base", "errors cand", "", "base s", "cand s"], rows)
    blocking = [f for f in z.get("findings") or [] if f.get("blocking")]
    if blocking:
        out += ["", "**Only the candidate has these (they block the go):**", ""]
        out += [f"- `{f['rule']}` {f.get('cell') or ''}: {f['message']}" for f in blocking]
    if z.get("failed"):
        out += ["", "Not fully checked: " + "; ".join(z["failed"])]
    return out


def _in_model(doc: dict, plots: dict[str, str] | None) -> list[str]:
    """The model check of the kept commit (`flaloop model`): the training step's time, paired as a
    bench cell, beside what the op's share predicts; the trajectory against the base's band."""
    m = doc["model"]
    spec, st, tr = m.get("model") or {}, m.get("step") or {}, m.get("trajectory") or {}
    out = [f"From `{_rel(doc, m.get('path'))}`: {spec.get('model_class')} (B{spec.get('batch')} T{spec.get('seq_len')} "
           f"{spec.get('dtype')}, `{m.get('command') or 'flaloop model ' + doc['op']}`).", ""]
    ci = f"[{fmt.num(st.get('ci_low'))}, {fmt.num(st.get('ci_high'))}]"
    out += fmt.table(["", "base ms", "candidate ms", "speedup", "95% CI", "verdict", "pairs", "op share", "predicted"],
                  [["training step", fmt.num(st.get("base_ms"), ".2f"), fmt.num(st.get("cand_ms"), ".2f"), fmt.num(st.get("speedup")),
                    ci, str(st.get("verdict")), str(st.get("pairs")), fmt.pct(st.get("op_share")), fmt.num(st.get("predicted"))]])
    out += ["", f"The prediction is the op's speedup ({fmt.num(st.get('op_speedup'))}x, {st.get('op_speedup_from')}) over "
                "its share of the step (Amdahl); the measured speedup is forward, backward and AdamW, device time."]
    j = tr.get("judgement") or {}
    if j:
        worst = ", ".join(f"{k} {v:.2f}x" for k, v in (j.get("worst") or {}).items())
        out += ["", f"Trajectory: {tr.get('steps')} steps; the band is {tr.get('band_scale'):g}x the widest of "
                    f"{tr.get('band_seeds')} base runs with the op's outputs moved by {tr.get('perturb'):g} relative RMS. "
                    f"The candidate stays {'inside' if j.get('inside') else '**outside**'} it (worst: {worst} the band)."]
    out += [f"- **{f['rule']}**: {f['message']}" for f in m.get("findings") or [] if f.get("blocking")]
    if plots and plots.get("model"):
        out += ["", f"![model]({Path(plots['model']).name})"]
    return out


def _profile(doc: dict) -> list[str]:
    p = doc["profile"]
    if not p:
        if doc.get("explanation"):
            return [f"No `flaloop profile` reading of the measured tree state (`{doc['commands']['profile']}` adds "
                    "one step's kernel tables and, with `--ncu`, Nsight Compute); the explanation above holds "
                    "the kernels' times of every cell."]
        return [f"No profiler reading of the measured tree state: `{doc['commands']['profile']}`."]
    cell = (p.get("cell") or {}).get("id")
    out = [f"One step of `{cell}` under torch.profiler ({p.get('kernels_are')}), base and candidate "
           f"(`{_rel(doc, p.get('_path'))}`):", ""]
    sides = {s: p.get(s) or {} for s in ("base", "cand")}
    what = "GPU kernel" if p.get("device") == "cuda" else "CPU op (self)"
    out += fmt.table(["", "base", "cand"], [
        [f"{what} time of the step (ms)", fmt.num(sides["base"].get("device_total_ms")), fmt.num(sides["cand"].get("device_total_ms"))],
        ["host wall time of the step (ms)", fmt.num(sides["base"].get("step_wall_ms")), fmt.num(sides["cand"].get("step_wall_ms"))],
        ["device busy, share of host time", fmt.pct(_share(sides["base"])), fmt.pct(_share(sides["cand"]))],
        ["kernel launches", sides["base"].get("n_launches", "-"), sides["cand"].get("n_launches", "-")],
    ]) + [""]
    names: list[str] = []
    for s in ("cand", "base"):
        for k in (sides[s].get("kernels") or [])[:8]:
            if k["name"] not in names:
                names.append(k["name"])
    by = {s: {k["name"]: k for k in sides[s].get("kernels") or []} for s in sides}
    rows = [[f"`{n[:70]}`", fmt.num((by["base"].get(n) or {}).get("total_ms")), (by["base"].get(n) or {}).get("launches", "-"),
             fmt.num((by["cand"].get(n) or {}).get("total_ms")), (by["cand"].get(n) or {}).get("launches", "-")] for n in names]
    out += fmt.table(["kernel", "base ms", "base launches", "cand ms", "cand launches"], rows) + [""]
    out += _reading(p, by) + [""]
    ncu = p.get("ncu") or {}
    if ncu.get("available"):
        summ = ncu.get("summary") or {}
        keys = sorted({k for s in summ.values() for k in (s or {}) if k != "kernels"})
        out += ["Nsight Compute (`--set full` + PmSampling, `--set source` + SourceCounters, `--clock-control none`):", ""]
        out += fmt.table(["metric", "base", "cand"], [[k, fmt.num((summ.get("base") or {}).get(k), ".1f"),
                                                    fmt.num((summ.get("cand") or {}).get(k), ".1f")] for k in keys])
    else:
        out.append(f"Nsight Compute: {ncu.get('reason') or 'not run (`flaloop profile OP --ncu`)'}.")
    return out


def _reading(p: dict, by: dict) -> list[str]:
    """What changed between the sides: the step's totals and the kernels that moved most."""
    b, c = p.get("base") or {}, p.get("cand") or {}
    out = []
    if b.get("device_total_ms") and c.get("device_total_ms"):
        out.append(f"Reading: the step's {'kernel' if p.get('device') == 'cuda' else 'op'} time went from "
                   f"{b['device_total_ms']:.4f} to {c['device_total_ms']:.4f} ms "
                   f"({b['device_total_ms'] / c['device_total_ms']:.3f}x) and its launches from "
                   f"{b.get('n_launches')} to {c.get('n_launches')}.")
    deltas = sorted(((by["cand"].get(n, {}).get("total_ms", 0.0) - by["base"].get(n, {}).get("total_ms", 0.0), n)
                     for n in set(by["base"]) | set(by["cand"])), key=lambda d: -abs(d[0]))[:3]
    moved = [f"`{n[:60]}` {d:+.4f} ms" for d, n in deltas if abs(d) > 0]
    if moved:
        out.append("Largest changes: " + ", ".join(moved) + ".")
    roof = p.get("roofline") or {}
    if roof.get("floor_ms"):
        out.append(f"Roofline of this cell ({roof['family']}): floor {roof['floor_ms']:.4f} ms, {roof['bound']}-bound; "
                   f"base at {fmt.pct(roof.get('pct_of_floor_base'))}, candidate at {fmt.pct(roof.get('pct_of_floor_cand'))}.")
    return out


def _share(side: dict):
    w, d = side.get("step_wall_ms"), side.get("device_total_ms")
    return 100.0 * d / w if w and d is not None else None


def _guard(doc: dict) -> list[str]:
    g = doc["guard"]
    if not g["ran"]:
        out = ["No guard findings recorded with this bench."]
    elif not g["findings"]:
        out = ["The guard ran and found nothing."]
    else:
        out = fmt.table(["rule", "severity", "where", "what", "allowed"],
                     [[f["rule"], f.get("severity"), f.get("where") or "", f.get("message"), f.get("allowed") or ""]
                      for f in g["findings"]])
    if g["allowed"]:
        out += ["", "Exceptions recorded in the contract:"]
        out += [f"- `{a.get('rule')}`: {a.get('why')} (added {a.get('added')})" for a in g["allowed"]]
    return out


def _trajectory(doc: dict) -> list[str]:
    rows = [[t["iter"], t["status"], t["direction"] or "", fmt.speedup(t["speedup"]),
             fmt.interval(t["ci_low"], t["ci_high"]) if t["speedup"] else "-",
             {True: "green", False: "red"}.get(t["gate_green"], "-"), str(t["commit"] or "")[:10], t["note"]]
            for t in doc["trajectory"]]
    out = fmt.table(["iter", "status", "direction", "vs base", "95% CI", "gate", "commit", "note"], rows)
    if doc.get("opt_log"):
        out += ["", f"Full log: `{_rel(doc, doc['opt_log'])}`"]
    return out

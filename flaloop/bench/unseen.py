"""Shapes nobody times: a seeded draw of small shapes that no bench cell and no shape config of
the op uses, for the warm-up to check base against candidate on (bench/warmup.check_unseen).

Why: undoing FLA's fix #988 (a kernel Triton miscompiles with 4 warps on Hopper) read FASTER 1.10x
on B8_T1024_H8_D64, its differential check passing there, while the candidate was wrong on
B1-T64-H2-D32, a shape only FLA's tests run. A bench that compares base and candidate on its own
cells alone cannot see that class; this draw gives it a few shapes of the other kind.

The draw is pure (the orchestrator's, in bench/plan.py, so that it is plain data in the plan and a
sweep's node runs the same shapes) and covers every dimension the op's shape configs declare:

- T: shape i takes T from one of three strata in turn: below any chunk (1, 2, 7, 15), one chunk
  but not a multiple of 16 (17, 31, 33, 47, 63), more than a chunk, not a multiple of 16 (65, 79,
  100, 127);
- head dims (D, K, V, DK, DV): powers of two (16, 32, 64) on even i, others (24, 40, 48) on odd i
  (with K and V both declared, V takes the other kind than K);
- B and H: 1, 2 or 3;
- a dimension flaloop knows nothing of (FLA's L, HQ): one of the values the op's own shape
  configs give it, since flaloop cannot tell what it must divide or match;
- a dimension the registry constrains (`dim_constraints`): only its allowed values (the smallest three);
- every value at most the largest the op's shape configs give that dimension;
- with varlen, every second shape is a packed batch (B=1) of two or three tiny sequences.

Where the target dispatches between backends (FLA's `fla.ops.backends`), a verifier may send the
drawn shapes elsewhere than the cells (the Gluon AttnRes backend takes no head dim under 128
bytes): the check would then compare code nobody times. The plan also holds `on_path`, the same
draw with the head dims pinned to the cells' own (ON_PATH shapes); the warm-up checks them only when
a backend that served a cell served none of the first shapes, and says so (`unseen-off-path`, a
warning) if they miss it too.

A drawn shape equal (over the op's dimensions) to a bench cell's or to any shape config of the op
is drawn again, as is one drawn twice. The same seed, shape configs and cells give the same
shapes: a fixed seed (BenchConfig.unseen_seed, default 0) lets the base's compiles of these shapes
be cached across runs and gives the same code the same answer every time; the record holds the
seed and the shapes themselves, so a finding is reproduced with the same --unseen-seed.

An A/A run (the baseline's) checks the same shapes with the base on both sides. It finds no
candidate wrong, but it compiles and autotunes their kernels into Triton's cache, so the first
iteration does not pay for that (on FLA's chunk_delta_rule on an H200 the first check of 4 shapes
took 216 s, 88% of that iteration's bench), and it says where the base differs from itself (a
shape where the check would read noise as a wrong candidate): `unstable`, never a finding.
"""

from __future__ import annotations

import random

# T: below any chunk; one chunk, not a multiple of 16; more than a chunk, not a multiple of 16;
# small multiples of the chunk sizes (FLA's miscompile of #988 was on B1-T64-H2-D32)
T_STRATA = ((1, 2, 7, 15), (17, 31, 33, 47, 63), (16, 32, 64, 128), (65, 79, 100, 127))
HEAD_POW2 = (16, 32, 64)
HEAD_OTHER = (24, 40, 48)
SMALL = (1, 2, 3)  # B, H
HEAD_DIMS = ("D", "K", "V", "DK", "DV")
CORE = ("B", "T", "H", "D")  # what a worker's cell spec needs (inside/worker/inputs.CellSpec.check)
MAX_TRIES = 200
ON_PATH = 2  # shapes drawn with the cells' head dims, for when the first draw missed the cells' backends


def _capped(pool: tuple[int, ...] | list[int], largest: int | None) -> list[int]:
    if largest is None:
        return list(pool)
    return [v for v in pool if v <= largest] or [min(pool)]


def _pools(dim: str, seen: list[int], constraints: dict, head_rank: int) -> list[list[int]]:
    """The pools `dim` cycles through, shape after shape (see the module docstring)."""
    largest = max(seen) if seen else None
    allowed = constraints.get(dim)
    if allowed:
        return [sorted(int(v) for v in allowed)[:3]]
    if dim == "T":
        return [_capped(p, largest) for p in T_STRATA]
    if dim in HEAD_DIMS:
        pools = [_capped(HEAD_POW2, largest), _capped(HEAD_OTHER, largest)]
        return pools[head_rank % 2:] + pools[:head_rank % 2]
    if dim in ("B", "H"):
        return [_capped(SMALL, largest)]
    return [sorted(set(seen)) or [1]]


def shape_name(shape: dict, seqlens: list[int] | None = None) -> str:
    """B1-T17-H3-D24 (the style of FLA's test ids), a packed batch with its lengths: B1-T23-H2-D24-seqlens1+17+5."""
    name = "-".join(f"{k}{v}" for k, v in shape.items())
    return name + ("-seqlens" + "+".join(map(str, seqlens)) if seqlens else "")


def dims_of(shape_configs: dict[str, dict]) -> list[str]:
    """The op's shape dimensions, in the order its configs name them (B, T, H, D at least)."""
    dims = list(CORE)
    for cfg in shape_configs.values():
        dims += [k for k in cfg if k not in dims and k != "seqlens"]  # a packed shape's lengths are no dimension
    return dims


def draw(shape_configs: dict[str, dict], *, n: int, seed: int, avoid: list[dict], varlen: bool = False,
         constraints: dict | None = None) -> list[dict]:
    """n shapes ({"name", "shape", "seqlens"}) as the module docstring says; fewer when the pools
    run out of shapes not in `avoid`.

    Spread rather than merely random, since n is small: each dimension cycles through its pools
    (T's strata, the two kinds of head dim) shape after shape, and through a seeded permutation
    of each pool, so that four shapes see every B and H of 1-3 at least once between them, every
    T stratum and both kinds of head dim. A shape that collides is drawn again at random."""
    rng = random.Random(f"flaloop-unseen:{int(seed)}")
    dims = dims_of(shape_configs)
    constraints = {k: list(v) for k, v in (constraints or {}).items() if v}
    seen = {d: [int(c[d]) for c in shape_configs.values() if isinstance(c.get(d), int)] for d in dims}
    heads = [d for d in dims if d in HEAD_DIMS]
    pools = {d: _pools(d, seen[d], constraints, heads.index(d) if d in heads else 0) for d in dims}
    cycles: dict[str, list[list[int]]] = {}
    used: list[list[int]] = []  # B and H share a pool: the same permutation would tie them together
    for d, ps in pools.items():
        cycles[d] = []
        for p in ps:
            perm = rng.sample(p, len(p))
            for _ in range(20):
                if perm not in used or len(p) < 2:
                    break
                perm = rng.sample(p, len(p))
            used.append(perm)
            cycles[d].append(perm)
    taken = {tuple(int(s.get(d, -1)) for d in dims) for s in avoid}
    out: list[dict] = []
    tries = attempts = 0  # in all; for the shape being drawn (its first try takes the cycles' values)
    while len(out) < n and tries < MAX_TRIES:
        i = len(out)
        tries += 1
        shape = {}
        for d in dims:
            k = len(cycles[d])
            cycle = cycles[d][i % k]
            shape[d] = cycle[(i // k) % len(cycle)] if attempts == 0 else rng.choice(cycle)
        attempts += 1
        seqlens = None
        if varlen and i % 2 == 1:
            lens = [rng.choice(T_STRATA[j % 2]) for j in range(rng.choice((2, 3)))]
            seqlens, shape["B"], shape["T"] = lens, 1, sum(lens)
        key = tuple(shape[d] for d in dims) + tuple(seqlens or ())
        if key in taken:
            continue
        taken.add(key)
        attempts = 0
        out.append({"name": shape_name(shape, seqlens), "shape": shape, "seqlens": seqlens})
    return out


def plan(cfg, shape_configs: dict[str, dict], cells: list, registry_entry: dict | None) -> dict:
    """What the warm-up checks on shapes nobody times: the draw and how to run it, or why not
    (`off`). Plain data for the plan (bench/plan.MeasurePlan.unseen)."""
    entry = registry_entry or {}
    modes = ["fwd"] if entry.get("skip_backward") else ["fwd", "fwdbwd"]
    out = {"n": cfg.unseen_shapes, "seed": cfg.unseen_seed, "dtype": cfg.dtype, "tol": cfg.diff_tol,
           "modes": modes, "shapes": [], "off": None, "aa": bool(cfg.aa)}
    if cfg.unseen_shapes <= 0:
        out["off"] = "--unseen-shapes 0"
    elif cfg.aa and cfg.signal:
        out["off"] = "a quick A/A: no candidate to check, and compiling them for later is not quick"
    if out["off"]:
        return out
    avoid = [dict(c.shape) for c in cells] + [dict(s) for s in shape_configs.values()]
    constraints = entry.get("dim_constraints") or {}
    out["shapes"] = draw(shape_configs, n=cfg.unseen_shapes, seed=cfg.unseen_seed, avoid=avoid, varlen=cfg.varlen,
                         constraints=constraints)
    # the same draw with the cells' own head dims: checked only where the cells' backends served none
    # of the shapes above (a verifier that sends small head dims to another backend)
    heads = {d: sorted({int(c.shape[d]) for c in cells if isinstance(c.shape.get(d), int)}) for d in HEAD_DIMS}
    pinned = {d: v for d, v in heads.items() if v}
    out["on_path"] = draw(shape_configs, n=min(ON_PATH, cfg.unseen_shapes), seed=cfg.unseen_seed,
                          avoid=avoid + [x["shape"] for x in out["shapes"]], varlen=cfg.varlen,
                          constraints={**constraints, **pinned}) if pinned else []
    return out

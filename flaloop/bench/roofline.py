"""Roofline: bytes moved and FLOPs per op family and shape, measured ceilings, % of the floor.

Pure (no torch): the counts are arithmetic on the cell's shape, and the ceilings come from
`flaloop/inside/scripts/ceilings.py`, run once per device in the target's interpreter and cached under
`$XDG_CACHE_HOME/flaloop/`. docs/ROOFLINE.md derives every formula; in short:

- bytes: compulsory HBM traffic. fwd reads every input once and writes the output once;
  fwdbwd adds the backward, which reads the inputs again plus dO and writes one gradient per
  input that requires one. Chunk-boundary states are intermediates a fused kernel may keep on
  chip, so they are not compulsory; initial and final states count only when passed.
- flops: the dominant matmuls of FLA's chunked algorithm (chunk C = 64) per token and head:
  `kv` state products of 2*K*V each, `ck` / `cv` triangular C x C products of C*K / C*V each
  (causal half of 2*C*K). Softmax attention: L^2*D per causal matmul, 2 in fwd, 5 in bwd.
  Attention over layers (AttnRes): 2*D per source and token for each length-D reduction, 3 in fwd,
  5 in bwd; memory-bound by far.
- floor_ms = max(bytes / bandwidth, flops / peak); % of floor = floor / measured.

A new family: add a `Family` to FAMILIES, map its registry `category` in CATEGORIES (and a
name pattern in NAME_PATTERNS), derive it in docs/ROOFLINE.md, and add a hand computation to
tests/unit/test_roofline.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flaloop import inside
from flaloop.core import clock, fsutil, procs
from flaloop.core.errors import MeasurementError, UsageError

CHUNK = 64
SCRIPT = inside.script("ceilings.py")
ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "long": 8, "int64": 8, "int32": 4}
# The shape helpers FLA's registry uses, as dimension letters; anything else is not modelled.
SHAPE_FNS = {"shape_BTHD": "BTHD", "shape_BTH": "BTH", "shape_BTD": "BTD", "shape_H": "H",
             "shape_HD": "HD", "shape_D": "D", "shape_LBTD": "LBTD"}


@dataclass(frozen=True)
class Products:
    """Matmuls of the chunked algorithm, counted per token and head (see docs/ROOFLINE.md)."""

    kv: int  # state products (C x K x V per chunk): 2*K*V FLOPs per token each
    ck: int  # triangular C x C x K products: C*K FLOPs per token each (causal half)
    cv: int  # triangular C x C x V products: C*V FLOPs per token each


@dataclass(frozen=True)
class InputSpec:
    name: str
    dims: str            # letters of the shape, e.g. "BTHD"
    dtype: str = "default"
    requires_grad: bool = True


@dataclass(frozen=True)
class Family:
    name: str
    title: str
    fwd: Products | None                  # the chunked algorithm's products; None for the other kinds
    bwd: Products | None
    inputs: tuple[InputSpec, ...]
    note: str = ""
    kind: str = "chunk"                   # how cell_cost counts FLOPs: "chunk", "softmax" or "layers"

    def with_inputs(self, inputs: tuple[InputSpec, ...]) -> Family:
        return Family(self.name, self.title, self.fwd, self.bwd, inputs, self.note, self.kind)

    def to_dict(self) -> dict:
        return asdict(self)


def _qkv(*extra: InputSpec) -> tuple[InputSpec, ...]:
    return (InputSpec("q", "BTHD"), InputSpec("k", "BTHD"), InputSpec("v", "BTHD"), *extra)


FAMILIES: dict[str, Family] = {
    "linear": Family("linear", "linear attention / retention", Products(2, 1, 1), Products(5, 3, 2), _qkv()),
    "gla": Family("gla", "gated linear attention (GLA, simple GLA)", Products(2, 1, 1), Products(5, 3, 2),
                  _qkv(InputSpec("g", "BTHD"))),
    "delta": Family("delta", "delta rule", Products(3, 3, 2), Products(8, 8, 5), _qkv(InputSpec("beta", "BTH"))),
    "gated_delta": Family("gated_delta", "gated delta rule", Products(3, 3, 2), Products(8, 8, 5),
                          _qkv(InputSpec("g", "BTH"), InputSpec("beta", "BTH"))),
    "softmax": Family("softmax", "causal softmax attention", None, None, _qkv(), kind="softmax"),
    # FLA's AttnRes: per token, a softmax over L residual sources (layers) of [B, T, D] each
    "attnres": Family("attnres", "attention over layers (AttnRes)", None, None,
                      (InputSpec("query", "D"), InputSpec("residuals", "LBTD"), InputSpec("rms_weight", "D")),
                      kind="layers"),
}

# FLA's registry `category` -> family. A category not listed here has no model.
CATEGORIES = {
    "simple_qkv": "linear", "lightning": "linear", "retention": "linear", "linear_attn": "linear",
    "elem_gate": "gla", "head_gate": "gla", "gla": "gla",
    "beta": "delta", "delta_rule": "delta",
    "gate_beta": "gated_delta", "gated_delta_rule": "gated_delta",
    "attn": "softmax", "flash_attn": "softmax", "softmax": "softmax",
    "fused_attnres": "attnres", "naive_attnres": "attnres",
}
# Only for ops without a category (flaloop.toml ops, small registries): first match wins.
NAME_PATTERNS = (
    (r"gated_delta|gdn|kda", "gated_delta"),
    (r"delta", "delta"),
    (r"gla", "gla"),
    (r"retention|linear_attn|lightning", "linear"),
    (r"attnres", "attnres"),
    (r"attn|attention", "softmax"),
)


def family_for(entry: dict | None, op: str | None = None) -> Family | None:
    """The family of a registry entry (target query JSON: name, category, inputs), or None.

    The category decides when it is set; only an entry without one falls back to the op name.
    The entry's TensorSpecs replace the family's default inputs when every shape is one the
    model knows.
    """
    entry = entry or {}
    category = (entry.get("category") or "").strip()
    name = entry.get("name") or op or ""
    if category:
        key = CATEGORIES.get(category)
    else:
        key = next((fam for pat, fam in NAME_PATTERNS if re.search(pat, name)), None)
    if key is None:
        return None
    fam = FAMILIES[key]
    specs = []
    for iname, spec in (entry.get("inputs") or {}).items():
        dims = SHAPE_FNS.get(spec.get("shape_fn") or "")
        if dims is None:
            return fam  # a shape the model does not know: keep the family's own inputs
        specs.append(InputSpec(iname, dims, spec.get("dtype") or "default", bool(spec.get("requires_grad", True))))
    return fam.with_inputs(tuple(specs)) if specs else fam


# -- counts -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Cost:
    bytes: int
    flops: int
    detail: dict = field(default_factory=dict)


def _elem(dtype: str, cell_dtype: str) -> int:
    name = cell_dtype if dtype in ("default", "", None) else str(dtype).replace("torch.", "")
    if name not in ELEMENT_BYTES:
        raise UsageError(f"no element size for dtype {name!r}")
    return ELEMENT_BYTES[name]


def _numel(dims: str, shape: dict) -> int:
    n = 1
    for d in dims:
        n *= int(shape["H"] * shape["D"] if d == "X" else shape[d])
    return n


def _dims_for(dims: str) -> str:
    # shape_BTD is (B, T, H*D): write H*D as one letter X.
    return "BTX" if dims == "BTD" else dims


def chunk_square_sum(lengths: list[int], chunk: int = CHUNK) -> int:
    """Sum over all chunks of every sequence of (chunk length)^2: the triangular work."""
    total = 0
    for n in lengths:
        full, rest = divmod(int(n), chunk)
        total += full * chunk * chunk + rest * rest
    return total


def cell_cost(family: Family, shape: dict, mode: str, dtype: str = "bfloat16",
              seqlens: list[int] | None = None, states: bool = False, chunk: int = CHUNK) -> Cost:
    """Compulsory bytes and dominant FLOPs of one call (fwd) or one fwd+bwd step (fwdbwd)."""
    if mode not in ("fwd", "fwdbwd"):
        raise UsageError(f"unknown mode {mode!r}")
    B, T, H, D = (int(shape[k]) for k in ("B", "T", "H", "D"))
    lengths = [int(x) for x in seqlens] if seqlens else [T] * B
    tokens = sum(lengths)
    K = V = D
    sizes = {s.name: _numel(_dims_for(s.dims), {**shape, "B": B, "T": T}) * _elem(s.dtype, dtype)
             for s in family.inputs}
    inputs = sum(sizes.values())
    out = B * T * H * V * _elem("default", dtype)
    grads = sum(sizes[s.name] for s in family.inputs
                if s.requires_grad and s.dtype in ("default", "float32", "bfloat16", "float16"))
    n_seq = len(lengths)
    state = n_seq * H * K * V * 4 if states and family.kind == "chunk" else 0  # fp32 states
    fwd_bytes = inputs + out + 2 * state                     # read h0, write hT
    bwd_bytes = inputs + out + grads + 2 * state             # read inputs + dO (+ h0, dhT); write grads (+ dh0)
    nbytes = fwd_bytes + (bwd_bytes if mode == "fwdbwd" else 0)

    if family.kind == "layers":  # per source and token: length-D reductions of 2*D FLOPs each
        L = int(shape["L"])
        fwd_flops = 3 * 2 * L * tokens * H * D   # the rms norm, the logit, the weighted sum
        bwd_flops = 5 * 2 * L * tokens * H * D   # the norm and logit again, dp, dv, dq and dw
        detail = {"sources": L}
    elif family.kind == "softmax":  # causal softmax attention
        sq = sum(n * n for n in lengths)
        fwd_flops = 2 * H * sq * D     # QK^T and PV, each L^2*D after the causal half
        bwd_flops = 5 * H * sq * D     # S recomputed, dV, dP, dQ, dK
        detail = {"sum_len_sq": sq}
    else:
        tri = chunk_square_sum(lengths, chunk)

        def flops(p: Products) -> int:
            return H * (p.kv * 2 * K * V * tokens + (p.ck * K + p.cv * V) * tri)

        fwd_flops, bwd_flops = flops(family.fwd), flops(family.bwd)  # type: ignore[arg-type]
        detail = {"chunk": chunk, "chunk_square_sum": tri}
    nflops = fwd_flops + (bwd_flops if mode == "fwdbwd" else 0)
    detail.update(tokens=tokens, input_bytes=inputs, output_bytes=out,
                  grad_bytes=grads if mode == "fwdbwd" else 0, state_bytes=state)
    return Cost(nbytes, nflops, detail)


# -- ceilings -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Ceilings:
    """What the device can do, measured: copy bandwidth (read + write) and dense GEMM rate."""

    device: str                 # "cuda" or "cpu"
    device_name: str
    device_uuid: str | None
    bandwidth_gbs: float        # GB/s, bytes read + written by a device copy
    peak_tflops: float          # TFLOP/s of a dense GEMM
    gemm_dtype: str
    copy_bytes: int = 0
    gemm_n: int = 0
    measured: str = ""
    torch: str | None = None

    def floor_ms(self, nbytes: int, nflops: int) -> tuple[float, str]:
        mem = nbytes / (self.bandwidth_gbs * 1e9) * 1e3
        comp = nflops / (self.peak_tflops * 1e12) * 1e3
        return (mem, "memory") if mem >= comp else (comp, "compute")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Ceilings:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})


def cache_path(device_uuid: str | None) -> Path:
    key = re.sub(r"[^A-Za-z0-9_.-]", "_", device_uuid) if device_uuid else "cpu"
    return fsutil.user_cache_dir() / f"ceilings-{key}.json"


def load_ceilings(device_uuid: str | None) -> Ceilings | None:
    p = cache_path(device_uuid)
    try:
        return Ceilings.from_dict(json.loads(p.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def measure_ceilings(python: str, device_uuid: str | None, timeout: float = 600) -> Ceilings:
    """Run the ceilings probe in the target's interpreter (on the GPU with this UUID, or the CPU)."""
    with tempfile.TemporaryDirectory(prefix="flaloop-ceilings-") as tmp:
        out = Path(tmp) / "ceilings.json"
        cmd = [python, str(SCRIPT), "--out", str(out)]
        cmd += ["--device", "cuda", "--uuid", device_uuid] if device_uuid else ["--device", "cpu"]
        try:
            proc = procs.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise MeasurementError(f"the ceilings probe did not finish: {exc}") from exc
        if not out.exists():
            raise MeasurementError(f"the ceilings probe failed (exit {proc.returncode})",
                                   (proc.stderr or proc.stdout)[-2000:])
        data = json.loads(out.read_text())
    if not data.get("ok"):
        raise MeasurementError(f"the ceilings probe failed: {data.get('error')}", data.get("traceback", "")[-2000:])
    data["measured"] = clock.now_iso()
    return Ceilings.from_dict(data)


def ceilings_for(python: str, device_uuid: str | None, refresh: bool = False) -> Ceilings:
    """The device's ceilings: from the cache, else measured once and cached."""
    if not refresh:
        cached = load_ceilings(device_uuid)
        if cached is not None:
            return cached
    c = measure_ceilings(python, device_uuid)
    fsutil.atomic_write_json(cache_path(device_uuid), c.to_dict())
    return c


# -- the record ---------------------------------------------------------------------------------

def annotate(record, ceilings: Ceilings | None, family: Family | None) -> None:
    """Set every cell's `roofline` (bench/model.CellRoofline) of a run record (bench/record.RunRecord),
    and `record.roofline`.

    A cell's roofline is its bytes, FLOPs, floor and each side's share of it, the bound, and
    `above_100`; None for a cell without a model. A cell above 100% of its floor ran faster than
    the device can move its compulsory bytes: the guard's "implausible" signal.
    """
    from flaloop.bench.model import CellRoofline

    if family is None:
        record.roofline = {"family": None, "reason": "no roofline model for this op (docs/ROOFLINE.md)"}
        for cell in record.cells:
            cell.roofline = None
        return
    record.roofline = {"family": family.name, "title": family.title, "chunk": CHUNK,
                       "ceilings": ceilings.to_dict() if ceilings else None, "model": "docs/ROOFLINE.md"}
    flagged = []
    for cell in record.cells:
        c = cell.cell
        try:
            cost = cell_cost(family, c.shape, c.mode, c.dtype or "bfloat16", list(c.seqlens) if c.seqlens else None)
        except (KeyError, UsageError, TypeError, ValueError):
            cell.roofline = None
            continue
        roof = CellRoofline(bytes=cost.bytes, flops=cost.flops)
        if ceilings is not None:
            # a hot cell's bytes may come from the L2, faster than the DRAM bandwidth measured: only
            # the compute floor bounds it
            floor, bound = ceilings.floor_ms(0 if c.l2 == "hot" else cost.bytes, cost.flops)
            pct = {side: (100.0 * floor / getattr(cell.summary, side).median
                          if getattr(cell.summary, side) is not None and getattr(cell.summary, side).median else None)
                   for side in ("base", "cand")}
            roof.floor_ms, roof.bound = floor, bound
            roof.pct_of_floor_base, roof.pct_of_floor_cand = pct["base"], pct["cand"]
            roof.above_100 = any(p is not None and p > 100.0 for p in pct.values())
            if roof.above_100:
                flagged.append(c.id)
        cell.roofline = roof
    record.roofline["above_100"] = flagged

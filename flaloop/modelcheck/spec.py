"""Which model an op is checked inside, and at what size: `ModelSpec`, the mapping flaloop keeps
for the registry's ops, and the contract's override.

The mapping is keyed by the op's package (the first segment of its `import_path`) and the
registry name. Each entry names a config class and a causal-LM class of the tree's own model
code, the layer's mode that reaches the op, and a small size. The FLA entries were read off
FLA's `fla/layers/*.py` (the function each layer calls in its `chunk` mode) and
`fla/models/*/configuration_*.py`; examples/minifla ships one model for its chunk op.

A contract overrides any field with a "model" object (`flaloop model OP --set KEY=VALUE` for one
run); `{"model": {"off": true}}` says the op has no model check.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

from flaloop.core.errors import UsageError

# FLA's DeltaNet LM at the size of the H200 trial in issue 40 (hidden 1024, 4 layers, B8 T2048):
# big enough that the op's share of the step is the share it has in training, small enough to
# build in seconds.
FLA_SIZE = {"hidden_size": 1024, "num_hidden_layers": 4, "vocab_size": 32000}


def _fla(config_class: str, model_class: str, **config) -> dict:
    return {"module": "fla.models", "config_class": config_class, "model_class": model_class,
            "config": {**FLA_SIZE, "attn_mode": "chunk", **config}, "batch": 8, "seq_len": 2048}


MODELS: dict[str, dict[str, dict]] = {
    "fla": {
        "chunk_delta_rule": _fla("DeltaNetConfig", "DeltaNetForCausalLM", num_heads=16),
        "chunk_gla": _fla("GLAConfig", "GLAForCausalLM", num_heads=4),
        "chunk_gdn": _fla("GatedDeltaNetConfig", "GatedDeltaNetForCausalLM", num_heads=8, head_dim=128),
        "chunk_kda": _fla("KDAConfig", "KDAForCausalLM", num_heads=16, head_dim=64),
        "chunk_retention": _fla("RetNetConfig", "RetNetForCausalLM", num_heads=8),
        "chunk_linear_attn": _fla("LinearAttentionConfig", "LinearAttentionForCausalLM", num_heads=4),
        "chunk_comba": _fla("CombaConfig", "CombaForCausalLM", num_heads=8, head_dim=128),
        "chunk_rwkv7": _fla("RWKV7Config", "RWKV7ForCausalLM", head_dim=64),
    },
    "minifla": {
        "chunk_linear_attn": {"module": "minifla.models", "config_class": "LinearAttnConfig",
                              "model_class": "LinearAttnForCausalLM",
                              "config": {"vocab_size": 64, "hidden_size": 32, "num_heads": 2, "num_hidden_layers": 1},
                              "batch": 1, "seq_len": 64, "dtype": "float32", "steps": 6, "warmup_steps": 1},
    },
}


@dataclass
class ModelSpec:
    """A model to check an op in: built from `module`'s classes in each side's own tree."""

    module: str
    config_class: str
    model_class: str
    config: dict = field(default_factory=dict)
    batch: int = 8
    seq_len: int = 2048
    dtype: str = "bfloat16"
    lr: float = 1e-3
    steps: int = 30              # training steps of each trajectory
    warmup_steps: int = 2        # steps before the first timed one (compile, autotune)
    band_seeds: int = 2          # perturbed base runs that make the band
    band_scale: float = 3.0      # how far past the widest perturbed run a candidate may go
    perturb: float | None = None  # relative RMS of the op-output noise; None: the bench's --diff-tol

    @property
    def vocab_size(self) -> int:
        return int(self.config.get("vocab_size", 32000))

    def to_wire(self) -> dict:
        return {**asdict(self), "vocab_size": self.vocab_size}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelSpec:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names - {"off"})
        if unknown:
            raise UsageError(f"unknown model field(s): {', '.join(unknown)}", f"the fields are: {', '.join(sorted(names))}")
        missing = [k for k in ("module", "config_class", "model_class") if not d.get(k)]
        if missing:
            raise UsageError(f"the model names no {', '.join(missing)}",
                             'give the contract a "model" object with module, config_class and model_class')
        return cls(**{k: v for k, v in d.items() if k in names})


def parse_sets(items: list[str]) -> dict:
    """`KEY=VALUE` overrides, VALUE read as JSON where it is (numbers, booleans, objects), a string
    otherwise; `config.KEY=VALUE` sets one key of the model's config."""
    out: dict = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--set {item!r} is not KEY=VALUE", "e.g. --set steps=20 or --set config.hidden_size=512")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        if key.startswith("config."):
            out.setdefault("config", {})[key[len("config."):]] = value
        else:
            out[key] = value
    return out


def resolve(op: str, import_path: str, contract_model: dict | None = None, sets: dict | None = None) -> ModelSpec:
    """The model `op` is checked in: the mapping's entry for its package, under the contract's
    "model" object and then the command's `--set`s; UsageError (exit 2) when there is none."""
    package = import_path.split(".")[0]
    base = MODELS.get(package, {}).get(op)
    merged: dict = dict(base or {})
    for over in (contract_model or {}, sets or {}):
        cfg = {**merged.get("config", {}), **over.get("config", {})}
        merged.update(over)
        if cfg:
            merged["config"] = cfg
    if merged.get("off"):
        raise UsageError(f"the contract says {op} has no model check (\"model\": {{\"off\": true}})",
                         "remove the contract's model.off to check it in a model")
    if not base and not (contract_model or {}).get("module") and not (sets or {}).get("module"):
        known = sorted(MODELS.get(package, {}))
        raise UsageError(f"no model is known for {op} (package {package}): flaloop maps "
                         + (", ".join(known) if known else "no op of this package"),
                         'name one in the contract: "model": {"module": ..., "config_class": ..., '
                         '"model_class": ..., "config": {...}}')
    return ModelSpec.from_dict(merged)

"""On the GPU, in FLA's interpreter: how far FLA's own honest reorderings move results, against what
rounding through a narrower dtype moves them (docs/GUARD.md, precision-narrowed).

For each op with a chunked and a recurrent form (the same recurrence summed in another order), at
B1 T8192 H4 D64 in fp32 and fp16: the relative RMS of the chunked output and final state against the
recurrent ones, and the chunked output rounded through bf16 and fp16 against itself. Writes JSON to
argv[1]; with argv[2], another run's JSON (its tensors beside it), each row also holds the chunked
form against that run's. Run once plainly and once with TRITON_F32_DEFAULT=ieee against the first:
the difference says whether FLA's fp32 path runs its products in TF32 (then its own reorderings
differ at TF32's level)."""

import json
import sys
import traceback

import torch
import torch.nn.functional as F


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm()) if float(b.norm()) else 0.0


def inputs(dtype, B=1, T=8192, H=4, D=64, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    def r(*s):
        return torch.randn(*s, device="cuda", generator=g)
    q, k, v = r(B, T, H, D), F.normalize(r(B, T, H, D), dim=-1), r(B, T, H, D)
    return {"q": q.to(dtype), "k": k.to(dtype), "v": v.to(dtype),
            "gk": F.logsigmoid(r(B, T, H, D) + 4).to(dtype),  # decays near 1: long memories
            "g": F.logsigmoid(r(B, T, H) + 4).to(dtype),
            "beta": torch.sigmoid(r(B, T, H)).to(dtype)}


def forms():
    from fla.ops.delta_rule import chunk_delta_rule, fused_recurrent_delta_rule
    from fla.ops.gla import chunk_gla, fused_recurrent_gla
    from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla
    return {
        "delta_rule": (lambda x: chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"], output_final_state=True),
                       lambda x: fused_recurrent_delta_rule(x["q"], x["k"], x["v"], x["beta"], output_final_state=True)),
        "gla": (lambda x: chunk_gla(x["q"], x["k"], x["v"], x["gk"], output_final_state=True),
                lambda x: fused_recurrent_gla(x["q"], x["k"], x["v"], gk=x["gk"], output_final_state=True)),
        "simple_gla": (lambda x: chunk_simple_gla(x["q"], x["k"], x["v"], x["g"], output_final_state=True),
                       lambda x: fused_recurrent_simple_gla(x["q"], x["k"], x["v"], x["g"], output_final_state=True)),
    }


def main(out_path: str, other: str | None = None) -> None:
    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "rows": []}
    for name, (chunk, recurrent) in forms().items():
        for dtype in (torch.float32, torch.float16):
            row = {"op": name, "dtype": str(dtype).replace("torch.", "")}
            try:
                x = inputs(dtype)
                o_c, h_c = chunk(x)
                o_r, h_r = recurrent(x)
                torch.cuda.synchronize()
                row.update(chunk_vs_recurrent_o=rel(o_c, o_r), chunk_vs_recurrent_h=rel(h_c, h_r),
                           o_through_bf16=rel(o_c.to(torch.bfloat16).to(dtype), o_c),
                           o_through_fp16=rel(o_c.to(torch.float16).to(dtype), o_c))
                torch.save({"o": o_c.cpu(), "h": h_c.cpu()}, f"{out_path}.{name}.{row['dtype']}.pt")
                if other:
                    theirs = torch.load(f"{other}.{name}.{row['dtype']}.pt")
                    row.update(vs_other_run_o=rel(o_c.cpu(), theirs["o"]), vs_other_run_h=rel(h_c.cpu(), theirs["h"]))
            except Exception as e:  # one op's failure is a row, not the script's end
                row["error"] = f"{type(e).__name__}: {e}"[:400]
                traceback.print_exc()
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)

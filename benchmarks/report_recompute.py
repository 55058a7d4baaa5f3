"""Restore versus recompute: does loading a request's state from statetier beat computing it?

``recompute_section(rows) -> list[str]`` — for each PD case of the run (a model geometry at
2k or 8k tokens), the decode side's measured restore (lookup + load of the whole request
through Redis) next to the prefill compute it replaces: ``Model.prefill_flops(tokens)`` on
``ACCELERATOR`` at ``MFU``. Also the break-even restore speed (state bytes ÷ recompute
time): an operator whose restore path moves bytes faster than that gains from offload.
The accelerator figures are stated assumptions, not measurements of this machine.
"""

from __future__ import annotations

from .workload_models import MODELS

MiB = 1024 * 1024
ACCELERATOR = "NVIDIA H100 SXM (bf16 dense peak 989 TFLOP/s)"
PEAK_FLOPS = 989e12
MFU = 0.40  # a typical prefill model-FLOPs utilisation for these sizes


def _model(display: str):
    return next(m for m in MODELS if m.display == display)


def recompute_section(rows: list[dict]) -> list[str]:
    restores = [r for r in rows if r["suite"] == "pd" and r["op"] == "lookup+load" and r["raw"] == "redis-py GET"]
    if not restores:
        return []
    effective = PEAK_FLOPS * MFU
    body = []
    for r in restores:
        model = _model(r["model"])
        flops = model.prefill_flops(r["tokens"])
        restore_s, compute_s = r["p50_us"] / 1e6, flops / effective
        verdict = (f"restore pays ({compute_s / restore_s:.1f}× faster)" if restore_s < compute_s
                   else f"recompute is {restore_s / compute_s:.1f}× faster")
        served = ", ".join(f"{tier} {n}" for tier, n in sorted(r.get("served_by_tier", {}).items())) or "–"
        body.append([r["case"], f"{r['size_bytes'] / MiB:.0f}", f"{restore_s:.3f}", served,
                     f"{flops / 1e12:.0f}", f"{compute_s:.3f}", f"{restore_s / compute_s:.2f}",
                     f"{r['size_bytes'] / compute_s / 1e9:.2f}", verdict])
    head = ["case", "state MiB", "restore s (lookup+load)", "loads served by tier", "prefill TFLOP",
            "recompute s", "ratio (restore ÷ recompute)", "break-even GB/s", "on this run"]
    lines = ["## Restore versus recompute", "",
             f"The prefill compute a restore replaces, against the decode side's measured restore of the same request "
             f"(the lookup+load rows above: joint-hit lookup, then every object from Redis, verified, into the "
             f"client). Compute = forward FLOPs of the prefill (2 × active parameters per token, plus causal "
             f"attention 2·N²·width per attention layer) on an **{ACCELERATOR} at {MFU:.0%} model-FLOPs "
             f"utilisation** ({PEAK_FLOPS * MFU / 1e12:.0f} TFLOP/s): an assumption, since this machine has no "
             f"accelerator. Break-even GB/s = state bytes ÷ recompute time: a restore path faster than that "
             f"makes offload pay.", "",
             *[f"- {m.display}: {m.params_source}." for m in MODELS], "",
             "| " + " | ".join(head) + " |", "|" + "|".join("---" if i in (0, 3, 8) else "---:"
                                                               for i in range(len(head))) + "|",
             *["| " + " | ".join(row) + " |" for row in body], "",
             _summary(body), ""]
    return lines


def _summary(body: list[list[str]]) -> str:
    pays = [row[0] for row in body if row[-1].startswith("restore pays")]
    loses = [row[0] for row in body if not row[-1].startswith("restore pays")]
    text = "In this run, restoring beat recomputing for " + (", ".join(pays) if pays else "no case")
    text += "; recomputing was faster for " + (", ".join(loses) if loses else "no case") + "."
    return (text + " Restore time grows with the state's bytes, recompute time with active parameters × tokens "
            "(and N² for attention): offload pays most where many active parameters stand behind each byte of "
            "state and prompts are long.")

"""Run the PD demo for every architecture and write its table into docs/integration.md.

    .venv/bin/python scripts/architecture_table.py [--redis-url URL] [--check]

Calls ``run_demo`` of examples/pd_disaggregation.py (one Redis, two daemons, a prefill and
a decode worker process) for every family in examples/tiny_hybrids.py, and replaces the
text between ``<!-- architecture-table:begin -->`` and ``<!-- architecture-table:end -->``
with one row per family: layers (attention / SSM), whether the decode side's tokens equal
single-process generation, the saved state's payload bytes, the handoff time (put +
publish, lookup, load) and the model's prefill time. A family this transformers cannot
build or run gets a row saying why. Exit status 1 when any family that ran decoded
different tokens; ``--check`` prints the table without writing the file.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "integration.md"
BEGIN, END = "<!-- architecture-table:begin -->", "<!-- architecture-table:end -->"

sys.path.insert(0, str(REPO / "examples"))

from pd_disaggregation import DemoResult, run_demo  # noqa: E402
from tiny_hybrids import ARCHITECTURES  # noqa: E402


def table(results: list[DemoResult]) -> str:
    import torch
    import transformers

    lines = [
        f"transformers {transformers.__version__}, torch {torch.__version__}, Python {platform.python_version()}; "
        "prompt 20 tokens, 8 decoded; times in ms on this machine, one run.",
        "",
        "| architecture | layers attention / SSM | tokens equal the reference | state bytes | handoff ms "
        "(put+publish / lookup / load) | prefill ms |",
        "|---|---|---|---:|---|---:|",
    ]
    for r in results:
        layers = f"{len(r.attention_layers)} / {len(r.ssm_layers)}"
        if r.skipped:
            lines.append(f"| {r.display} | – | skipped: {r.skipped} | – | – | – |")
        elif r.error:
            lines.append(f"| {r.display} | {layers} | **failed**: {r.error} | – | – | – |")
        else:
            verdict = "yes" if r.equal else f"**no** ({r.tokens} vs {r.reference})"
            lines.append(f"| {r.display} | {layers} | {verdict} | {r.state_bytes:,} | {r.handoff_ms:.1f} "
                         f"({r.put_ms:.1f} / {r.lookup_ms:.1f} / {r.load_ms:.1f}) | {r.prefill_ms:.1f} |")
    return "\n".join(lines)


def write_into(doc: Path, text: str) -> None:
    content = doc.read_text()
    if BEGIN not in content or END not in content:
        raise SystemExit(f"{doc} lacks the markers {BEGIN} … {END}")
    head, rest = content.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", help="use this Redis instead of starting one")
    parser.add_argument("--check", action="store_true", help="print the table, leave the doc alone")
    args = parser.parse_args(argv)
    results = run_demo(list(ARCHITECTURES), redis_url=args.redis_url)
    text = table(results)
    print(text)
    if not args.check:
        write_into(DOC, text)
        print(f"\nwritten into {DOC.relative_to(REPO)}")
    ran = [r for r in results if not r.skipped]
    return 0 if ran and all(r.equal for r in ran) else 1


if __name__ == "__main__":
    sys.exit(main())

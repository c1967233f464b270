"""Summarise Nsight Compute's per-instruction warp-stall samples (``--page source --print-source sass --csv``).

    python benchmarks/kernels/ncu_stall_summary.py source.csv [--top 40]

Prints the share of all samples per stall reason, and the instructions that gather the most samples with
their two largest reasons, so that a wait (a barrier, a scoreboard, the tensor pipe) can be tied to the code
line that waits.
"""

from __future__ import annotations

import argparse
import csv
import io
import sys


def _rows(path: str):
    text = open(path, errors="replace").read()
    start = text.find('"Address"')  # ncu prints its own log lines before the table
    return list(csv.DictReader(io.StringIO(text[start if start >= 0 else 0:])))


def _num(v) -> float:
    try:
        return float(str(v).replace(",", ""))
    except ValueError:
        return 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args(argv)
    rows = _rows(args.csv)
    if not rows:
        print("no rows")
        return 1
    cols = list(rows[0])
    total_col = next((c for c in cols if c.startswith("Warp Stall Sampling (All")), None)
    # one column per reason ("stall_long_sb", "stall_long_sb (Not Issued)", ...); those never sampled left out
    reasons = [c for c in cols if c.lower().startswith(("stall", "smsp__pcsamp"))
               and any(_num(r.get(c)) for r in rows[:2000])]
    src = next((c for c in cols if c == "Source"), cols[1])
    total = sum(_num(r[total_col]) for r in rows) or 1.0
    print(f"{len(rows)} instructions, {total:.0f} samples; columns: {', '.join(cols[:12])} ...")
    sums = {c: sum(_num(r[c]) for r in rows) for c in reasons}
    for c, v in sorted(sums.items(), key=lambda kv: -kv[1])[:14]:
        print(f"  {c}: {100 * v / total:.1f}%")
    print(f"top {args.top} instructions by samples (address, share, two largest reasons, source):")
    for r in sorted(rows, key=lambda r: -_num(r[total_col]))[: args.top]:
        top2 = sorted(((c, _num(r[c])) for c in reasons), key=lambda kv: -kv[1])[:2]
        why = ", ".join(f"{c.replace('stall_', '')} {100 * v / total:.1f}%" for c, v in top2 if v)
        print(f"  {r.get('Address', '?'):>6} {100 * _num(r[total_col]) / total:5.2f}%  [{why}]  {r[src][:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

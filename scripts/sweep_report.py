"""Turn a Hydra multirun directory of hpdcp jobs into a table and a plot.

    python scripts/sweep_report.py multirun/2026-12-02_14-15-24_f8584e [--objective result.objective] [--maximize]

Writes ``report.md``, ``report.csv`` and ``report.png`` (the objective against each swept knob)
into the multirun directory and prints the best point as a ready-to-paste override line.
Failed points (a ``FAILED`` marker or no ``metrics.json``) are listed, not plotted.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys

import yaml


def _get(doc, path: str):
    for part in path.split("."):
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


def collect(root: str, objective: str) -> tuple[list[dict], list[str]]:
    rows, knobs = [], []
    for name in sorted(os.listdir(root), key=lambda n: (not n.isdigit(), int(n) if n.isdigit() else n)):
        job = os.path.join(root, name)
        ov_path = os.path.join(job, ".hydra", "overrides.yaml")
        if not os.path.isfile(ov_path):
            continue
        with open(ov_path) as f:
            overrides = yaml.safe_load(f) or []
        row = {"point": name, "overrides": overrides, "objective": None, "status": "ok"}
        for o in overrides:
            k, _, v = o.lstrip("+~").partition("=")
            row[k] = v
        metrics = os.path.join(job, "metrics.json")
        if os.path.exists(os.path.join(job, "FAILED")) or not os.path.isfile(metrics):
            row["status"] = "failed"
        else:
            with open(metrics) as f:
                row["objective"] = float(_get(json.load(f), objective))
        rows.append(row)
    swept = {}
    for r in rows:
        for o in r["overrides"]:
            k = o.lstrip("+~").partition("=")[0]
            swept.setdefault(k, set()).add(r[k])
    knobs = [k for k, vals in swept.items() if len(vals) > 1]
    return rows, knobs


def _sort_key(v: str):
    from hpdcp_runner.config import parse_size

    try:
        return (0, float(v))
    except ValueError:
        try:
            return (0, float(parse_size(v)))
        except Exception:
            return (1, v)


def write(root: str, rows: list[dict], knobs: list[str], objective: str, maximize: bool) -> dict | None:
    ok = [r for r in rows if r["status"] == "ok"]
    ok.sort(key=lambda r: -r["objective"] if maximize else r["objective"])
    failed = [r for r in rows if r["status"] != "ok"]
    cols = ["point", *knobs, "objective", "status"]
    with open(os.path.join(root, "report.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for r in ok + failed:
            w.writerow([r.get(c, "") if r.get(c) is not None else "" for c in cols])
    lines = [f"# Sweep report: {root}", "", f"objective: `{objective}` ({'max' if maximize else 'min'} is best)", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in ok + failed:
        lines.append("| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in cols) + " |")
    best = ok[0] if ok else None
    if best:
        lines += ["", "Best point:", "", "```", " ".join(o for o in best["overrides"]), "```"]
    with open(os.path.join(root, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    _plot(os.path.join(root, "report.png"), ok, knobs, objective)
    return best


def _plot(path: str, ok: list[dict], knobs: list[str], objective: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(1, len(knobs))
    fig, axes = plt.subplots(1, n, figsize=(4.5 * n, 3.6), squeeze=False)
    for ax, knob in zip(axes[0], knobs or ["point"]):
        values = sorted({r[knob] for r in ok}, key=_sort_key)
        xs = {v: i for i, v in enumerate(values)}
        ax.scatter([xs[r[knob]] for r in ok], [r["objective"] for r in ok])
        for v in values:  # the best objective at each value of this knob
            best = min(r["objective"] for r in ok if r[knob] == v)
            ax.plot([xs[v] - 0.25, xs[v] + 0.25], [best, best], color="tab:red")
        ax.set_xticks(range(len(values)), values, rotation=30)
        ax.set_xlabel(knob)
        ax.set_ylabel(objective)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("multirun_dir")
    ap.add_argument("--objective", default="result.objective", help="dotted path into metrics.json")
    ap.add_argument("--maximize", action="store_true")
    args = ap.parse_args(argv)
    rows, knobs = collect(args.multirun_dir, args.objective)
    if not rows:
        print(f"no sweep jobs under {args.multirun_dir}", file=sys.stderr)
        return 2
    best = write(args.multirun_dir, rows, knobs, args.objective, args.maximize)
    print(open(os.path.join(args.multirun_dir, "report.md")).read())
    if best is None:
        print("every point failed", file=sys.stderr)
        return 1
    print("best:", " ".join(best["overrides"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

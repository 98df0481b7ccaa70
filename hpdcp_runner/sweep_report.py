"""Turn a Hydra multirun directory of hpdcp jobs into a table and a plot.

    python -m hpdcp_runner.sweep_report multirun/2026-12-02_14-15-24_f8584e [--objective result.objective] [--maximize]

Writes ``report.md``, ``report.csv`` and ``report.png`` (the objective against each swept knob,
min-max bars) into the multirun directory. Where the job records the objective's spread
(``<objective>_range``: the min and max over its repeats, as the bench job does), points whose
range overlaps the best point's are marked "within noise" and no single best is named from
noise; a best point is named (a ready-to-paste override line) only where every point's spread was
measured and the best stands out of it. Any job can be swept: every job records
``result.objective`` (see ``OBJECTIVE_PHASES`` in ``hpdcp_runner/jobs``). Failed points (a
``FAILED`` marker or no ``metrics.json``) and points without the objective are listed with their
cause (for the latter: the metrics they do have), not plotted. The plot
needs matplotlib (``pip install 'hpdcp_runner[report]'``), checked before anything is written;
``--no-plot`` skips it.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import json
import os
import re
import sys

import yaml


def _get(doc, path: str):
    from hpdcp_runner.launch import lookup

    return lookup(doc, path)


def unescape(override: str) -> str:
    """An override as a user types it: Hydra records ``s3://b`` as ``s3\\://b`` (its grammar's
    escapes), which reads wrong in a report; the CLI takes the unescaped form."""
    return re.sub(r"\\([\\()\[\]{}:=, ])", r"\1", override)


#: what a rank reports of another rank's failure (its peer gone, or silent past the timeout)
_ECHO = re.compile(r"(\[rank\d+\] )?(PeerLostError|CollectiveTimeoutError):")


def root_cause(failed: str) -> str:
    """The cause a point's ``FAILED`` marker gives: each failing rank appends its own line, in
    whatever order they got there; the first line that is not a rank's report of another rank's
    failure (a peer lost, a timeout) is the cause, else the first line."""
    lines = [x for x in failed.strip().splitlines() if x.strip()]
    return next((x for x in lines if not _ECHO.match(x)), lines[0] if lines else "")


def collect(root: str, objective: str) -> tuple[list[dict], list[str]]:
    rows, knobs = [], []
    for name in sorted(os.listdir(root), key=lambda n: (not n.isdigit(), int(n) if n.isdigit() else n)):
        job = os.path.join(root, name)
        ov_path = os.path.join(job, ".hydra", "overrides.yaml")
        if not os.path.isfile(ov_path):
            continue
        with open(ov_path) as f:
            overrides = [unescape(str(o)) for o in yaml.safe_load(f) or []]
        row = {"point": name, "overrides": overrides, "objective": None, "status": "ok", "range": None, "cause": ""}
        for o in overrides:
            k, _, v = o.lstrip("+~").partition("=")
            row[k] = v
        metrics = os.path.join(job, "metrics.json")
        marker = os.path.join(job, "FAILED")
        if os.path.exists(marker) or not os.path.isfile(metrics):
            row["status"] = "failed"
            if os.path.isfile(marker):
                with open(marker) as f:
                    row["cause"] = root_cause(f.read())
        else:
            with open(metrics) as f:
                doc = json.load(f)
            result = doc.get("result") if isinstance(doc.get("result"), dict) else {}
            row["no_effect"] = [k for k in result.get("no_effect") or [] if isinstance(k, str)]
            row["store_timed"] = result.get("store_timed")
            summary = doc.get("summary") if isinstance(doc.get("summary"), dict) else {}
            row["phases"] = {p: float(v["seconds_max"]) for p, v in summary.items()
                             if isinstance(v, dict) and isinstance(v.get("seconds_max"), (int, float))
                             and not p.startswith("warmup.")}
            row["objective_is"] = result.get("objective_is")
            try:
                row["objective"] = float(_get(doc, objective))
            except (KeyError, TypeError, ValueError):
                from hpdcp_runner.launch import metric_paths

                have = [p for p in metric_paths(doc) if p.startswith(("result.", "summary."))]
                row["status"] = "no objective"
                row["cause"] = f"no {objective} in its metrics.json (job {doc.get('job')}); it has: {', '.join(have[:12])}"
                rows.append(row)
                continue
            try:
                lo, hi = _get(doc, objective + "_range")
                if float(lo) < float(hi):  # one sample (min == max) measures no spread
                    row["range"] = (float(lo), float(hi))
            except (KeyError, IndexError, TypeError, ValueError):
                pass
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


def _noise_verdicts(ok: list[dict]) -> None:
    """``vs_best`` per point: best, within noise (its min-max overlaps the best's) or a clear
    difference; '' where the objective has no recorded spread."""
    if not ok or ok[0]["range"] is None:
        for r in ok:
            r["vs_best"] = ""
        return
    blo, bhi = ok[0]["range"]
    ok[0]["vs_best"] = "best"
    for r in ok[1:]:
        if r["range"] is None:
            r["vs_best"] = ""
        else:
            lo, hi = r["range"]
            r["vs_best"] = "within noise" if lo <= bhi and blo <= hi else "clearly different"


def write(root: str, rows: list[dict], knobs: list[str], objective: str, maximize: bool,
          plot: bool = True) -> tuple[dict | None, list[dict]]:
    """Writes the report; returns (the best point if it stands out of the noise, the points tied
    with it within noise)."""
    ok = [r for r in rows if r["status"] == "ok"]
    ok.sort(key=lambda r: -r["objective"] if maximize else r["objective"])
    failed = [r for r in rows if r["status"] != "ok"]
    _noise_verdicts(ok)
    tied = [r for r in ok if r.get("vs_best") == "within noise"]
    measured = bool(ok) and all(r["range"] is not None for r in ok)
    # a best point only where every point's spread was measured and the best stands out of it:
    # one sample per point cannot tell a 5% difference from the machine's noise
    best = ok[0] if ok and measured and not tied else None
    idle = [k for k in knobs if ok and all(k in r.get("no_effect", ()) for r in ok)]
    if idle and set(idle) == set(knobs):  # nothing swept changed what was timed: no point is better
        best = None
    if ok and ok[0].get("vs_best") == "best" and best is None:  # the table never says "best" where the text does not
        ok[0]["vs_best"] = "highest median" if maximize else "lowest median"
    others = _other_phases(ok, objective)
    for r in ok:
        r["min_max"] = f"{r['range'][0]:.4g}-{r['range'][1]:.4g}" if r["range"] else ""
        for p in others:
            r[p] = f"{r['phases'][p]:.4g}"
    cols = ["point", *knobs, "objective", "min_max", "vs_best", *others, "status", "cause"]
    with open(os.path.join(root, "report.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for r in ok + failed:
            w.writerow([r.get(c, "") if r.get(c) is not None else "" for c in cols])
    stores = sorted({str(r["store_timed"]) for r in ok if r.get("store_timed")})
    lines = [f"# Sweep report: {root}", "", f"objective: `{objective}` ({'max' if maximize else 'min'} is best)"
             + (f", from `{ok[0]['objective_is']}`" if ok and ok[0].get("objective_is") else "")]
    if stores:
        lines.append(f"storage timed: {'; '.join(stores)}")
    lines += ["", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in ok + failed:
        lines.append("| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in cols) + " |")
    for p in others:  # what the ranking by the objective leaves out, said where it differs
        lo, hi = min(ok, key=lambda r: r["phases"][p]), max(ok, key=lambda r: r["phases"][p])
        if hi["phases"][p] > 1.1 * lo["phases"][p]:
            lines += ["", f"Also timed, not ranked: `{p}` (seconds, max over ranks) is lowest at point {lo['point']} "
                          f"({lo['phases'][p]:.4g}) and highest at point {hi['point']} ({hi['phases'][p]:.4g}); "
                          f"sweep with --objective summary.{p}.seconds_max to rank by it."]

    def named(r: dict) -> str:
        return f"point {r['point']} ({' '.join(r['overrides'])})"

    if idle:  # e.g. an object store's knobs swept over a bench that timed a local directory
        lines += ["", f"No effect: {', '.join(idle)} do not apply to the storage timed ({ok[0].get('store_timed')}); "
                  f"the differences above between their values are the machine's noise."]
    if idle and set(idle) == set(knobs):
        tied = []
    elif best:
        lines += ["", "Best point:", "", "```", " ".join(o for o in best["overrides"]), "```"]
    elif tied:
        lines += ["", f"No single best point: {len(tied)} point(s) are within the measured noise (min-max overlap) "
                  f"of the lowest median, {named(ok[0])}: {'; '.join(named(r) for r in tied)}. "
                  f"Repeat with more job.repeats to separate them."]
    elif len(ok) > 1:
        tied = ok[1:]
        lines += ["", f"No best point named: the objective has no measured spread (one sample per point), so the "
                  f"ordering above may be noise. Lowest: {named(ok[0])}. Time repeats (+job=bench "
                  f"job.repeats=5) to compare points."]
    with open(os.path.join(root, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    if plot:
        _plot(os.path.join(root, "report.png"), ok, knobs, objective)
    return best, ([ok[0], *tied] if tied else [])


MAX_OTHER_PHASES = 4


def _other_phases(ok: list[dict], objective: str) -> list[str]:
    """Timed phases every point recorded, besides the one the objective is (a bench ranked on
    its load time also timed its save): shown beside it, at most ``MAX_OTHER_PHASES``."""
    if not ok:
        return []
    own = {objective.removeprefix("summary.").removesuffix(".seconds_max")}
    own |= {str(r.get("objective_is") or "").removeprefix("summary.").removesuffix(".seconds_max") for r in ok}
    common = set.intersection(*(set(r.get("phases") or {}) for r in ok))
    return sorted(p for p in common if p not in own)[:MAX_OTHER_PHASES]


def _plot(path: str, ok: list[dict], knobs: list[str], objective: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit = " (s)" if objective.endswith(("objective", "_s")) else ""
    n = max(1, len(knobs))
    fig, axes = plt.subplots(1, n, figsize=(4.8 * n, 3.9), squeeze=False)
    for ax, knob in zip(axes[0], knobs or ["point"]):
        values = sorted({r[knob] for r in ok}, key=_sort_key)
        xs = {v: i for i, v in enumerate(values)}
        x = [xs[r[knob]] for r in ok]
        y = [r["objective"] for r in ok]
        if all(r["range"] for r in ok):
            err = [[r["objective"] - r["range"][0] for r in ok], [r["range"][1] - r["objective"] for r in ok]]
            ax.errorbar(x, y, yerr=err, fmt="o", capsize=3, label="median, min-max over repeats")
        else:
            ax.scatter(x, y, label="objective per point")
        for i, v in enumerate(values):  # the best objective at each value of this knob
            best = min(r["objective"] for r in ok if r[knob] == v)
            ax.plot([xs[v] - 0.25, xs[v] + 0.25], [best, best], color="tab:red",
                    label="best at this value" if i == 0 else None)
        ax.set_xticks(range(len(values)), values, rotation=30)
        ax.set_xlabel(knob)
        ax.set_ylabel(objective + unit)
        ax.set_title(f"{objective} vs {knob}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"sweep of {len(ok)} points (lower is better)" if ok else "sweep")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _have(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("multirun_dir")
    ap.add_argument("--objective", default="result.objective", help="dotted path into metrics.json")
    ap.add_argument("--maximize", action="store_true")
    ap.add_argument("--no-plot", action="store_true", help="skip report.png (no matplotlib needed)")
    args = ap.parse_args(argv)
    if not args.no_plot and not _have("matplotlib"):
        print("the sweep plot needs matplotlib: pip install 'hpdcp_runner[report]' (or pass --no-plot); "
              "nothing was written", file=sys.stderr)
        return 2
    rows, knobs = collect(args.multirun_dir, args.objective)
    if not rows:
        print(f"no sweep jobs under {args.multirun_dir}", file=sys.stderr)
        return 2
    best, tied = write(args.multirun_dir, rows, knobs, args.objective, args.maximize, plot=not args.no_plot)
    print(open(os.path.join(args.multirun_dir, "report.md")).read())
    if not any(r["status"] == "ok" for r in rows):
        print("every point failed", file=sys.stderr)
        return 1
    if best is not None:
        print("best:", " ".join(best["overrides"]))
    elif tied and all(r["range"] is not None for r in tied):  # tied[0] is the lowest median itself
        print("no single best point; lowest median:", " ".join(tied[0]["overrides"]), "| within noise of it:",
              "; ".join(" ".join(r["overrides"]) for r in tied[1:]))
    elif tied:
        print("no best point (no measured spread, one sample per point); lowest:", " ".join(tied[0]["overrides"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run the fault suite and write docs/fault_table.md from what the tests observed.

    python scripts/fault_table.py            # runs pytest tests/faults, then writes the table

Each test in tests/faults records a row (fault, behaviour, error type, what the message names,
whether the previous checkpoint still loads bitwise, whether a payload's marker file stayed
absent, what `verify` reported) only after its assertions passed; the table is written only if
the whole suite passed.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cell(v) -> str:
    if v is None:
        return "—"
    if v is True:
        return "yes"
    if v is False:
        return "**no**"
    return str(v).replace("|", "\\|")


def render(rows: list[dict], command: str) -> str:
    out = ["# Fault table", "", f"Generated {_dt.date.today().isoformat()} by `{command}` from the rows the fault "
           f"suite (`tests/faults/`) recorded after its assertions passed. \"previous intact\": the checkpoint "
           f"that existed before the fault (or the other checkpoints) still loads bit for bit. \"marker absent\": "
           f"a pickle payload's marker file was never created.", ""]
    cats: dict[str, list[dict]] = {}
    for r in rows:
        cats.setdefault(r["category"], []).append(r)
    for cat, rs in cats.items():
        out += [f"## {cat}", "", "| fault | behaviour | error | message names | previous intact | marker absent | verify |",
                "|---|---|---|---|---|---|---|"]
        for r in rs:
            out.append("| " + " | ".join(_cell(r[k]) for k in ("fault", "behaviour", "error", "named",
                                                                "previous_intact", "marker_absent", "verify")) + " |")
        out.append("")
    return "\n".join(out)


def main() -> int:
    fd, path = tempfile.mkstemp(suffix=".jsonl")
    os.close(fd)
    env = dict(os.environ, HPDCP_FAULT_TABLE=path, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "slow or not slow", "tests/faults"], cwd=ROOT, env=env)
    if r.returncode != 0:
        print("the fault suite failed; table not written", file=sys.stderr)
        return r.returncode
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    os.unlink(path)
    os.makedirs(os.path.join(ROOT, "docs"), exist_ok=True)
    dest = os.path.join(ROOT, "docs", "fault_table.md")
    with open(dest, "w") as f:
        f.write(render(rows, "python scripts/fault_table.py") + "\n")
    print(f"{len(rows)} rows -> {dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``python scripts/sweep_report.py <sweep dir>``: the same as ``python -m hpdcp_runner.sweep_report``
(the report lives in the package so an installed runner has it)."""

from hpdcp_runner.sweep_report import main

if __name__ == "__main__":
    raise SystemExit(main())

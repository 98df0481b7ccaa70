"""The sweep report says when the knobs swept did not apply to what was timed (an object store's
knobs over a bench of a local directory), and then names no best point."""

import json

from hpdcp_runner.sweep_report import collect, write


def _point(root, i, overrides, objective, no_effect):
    d = root / str(i)
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    result = {"objective": objective, "objective_range": [objective * 0.99, objective * 1.01],
              "store_timed": "local directory /tmp/x"}
    if no_effect:
        result["no_effect"] = no_effect
    (d / "metrics.json").write_text(json.dumps({"result": result}))


def test_knobs_that_did_not_apply_are_named_and_no_best_point_is(tmp_path):
    idle = tmp_path / "idle"
    for i, c in enumerate((2, 8)):
        _point(idle, i, [f"dcp.storage.concurrency={c}"], 1.0 + i, ["dcp.storage.concurrency"])
    rows, knobs = collect(str(idle), "result.objective")
    best, tied = write(str(idle), rows, knobs, "result.objective", False, plot=False)
    md = (idle / "report.md").read_text()
    assert best is None and tied == [], best
    assert "No effect: dcp.storage.concurrency do not apply to the storage timed (local directory /tmp/x)" in md
    assert "Best point" not in md
    used = tmp_path / "used"  # the same clear difference, knobs that applied: a best point
    for i, c in enumerate((2, 8)):
        _point(used, i, [f"dcp.storage.concurrency={c}"], 1.0 + i, [])
    rows, knobs = collect(str(used), "result.objective")
    best, _ = write(str(used), rows, knobs, "result.objective", False, plot=False)
    assert best is not None and best["overrides"] == ["dcp.storage.concurrency=2"]
    assert "No effect" not in (used / "report.md").read_text()


def test_the_report_says_what_it_timed_what_it_did_not_rank_and_no_best_inside_noise(tmp_path):
    """Issue 54 item 9: the report did not say which store was timed, ranked on load time alone
    while the save medians (17.1 s vs 12.3 s) went unmentioned, and labelled a row "best" in a
    table whose text said every difference was noise."""
    root = tmp_path / "sweep"
    for i, (load, save) in enumerate(((10.0, 17.1), (10.2, 12.3))):
        d = root / str(i)
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text(f"- dcp.storage.concurrency={4 * (i + 1)}\n")
        result = {"objective": load, "objective_range": [9.0, 11.0], "objective_is": "summary.bench.load.seconds_max",
                  "store_timed": "Azure Blob Storage az://ckpts (endpoint http://127.0.0.1:10000/devstoreaccount1)"}
        summary = {"bench.load": {"seconds_max": load}, "bench.save": {"seconds_max": save}}
        (d / "metrics.json").write_text(json.dumps({"result": result, "summary": summary}))
    rows, knobs = collect(str(root), "result.objective")
    best, tied = write(str(root), rows, knobs, "result.objective", False, plot=False)
    md = (root / "report.md").read_text()
    assert best is None and len(tied) == 2
    assert "storage timed: Azure Blob Storage az://ckpts" in md
    assert "| best |" not in md and "| lowest median |" in md
    assert "Also timed, not ranked: `bench.save` (seconds, max over ranks) is lowest at point 1 (12.3) and highest at " \
           "point 0 (17.1)" in md


def test_a_failed_point_is_reported_by_its_cause_not_by_a_peers_echo_of_it():
    """Each failing rank appends its own line to FAILED, in the order they got there: rank 1
    may write 'PeerLostError' (rank 0 gone) before rank 0 writes why it failed."""
    from hpdcp_runner.sweep_report import root_cause

    echo = "[rank1] PeerLostError: during 'bench: where the timed checkpoints go' a peer rank's connection closed"
    cause = "[rank0] RuntimeError: injected failure on rank 0 (job.fail_on_rank)"
    assert root_cause(f"{echo}\n{cause}\n") == cause
    assert root_cause(f"{cause}\n{echo}\n") == cause
    timeout = "[rank1] CollectiveTimeoutError: rank 0 did not reach 'save: commit' within 20 s"
    assert root_cause(f"{timeout}\n") == timeout  # only echoes: the first is all there is
    assert root_cause("") == ""

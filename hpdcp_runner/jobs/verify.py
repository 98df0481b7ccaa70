"""verify: recompute every checksum and check structure; non-zero exit naming every problem."""

from __future__ import annotations

from ..dcp.errors import CorruptCheckpointError
from ..dcp.inspection import verify
from .context import JobContext


def run(ctx: JobContext) -> dict:
    if ctx.info.rank != 0:
        return {}
    with ctx.metrics.phase("verify"):
        report = verify(ctx.checkpoint_path())
    if not report.ok:
        raise CorruptCheckpointError(f"{report.path}: {len(report.problems)} problem(s):\n  - "
                                     + "\n  - ".join(report.problems))
    print(f"OK: {report.path}: {report.files_checked} files, {report.bytes_checked} bytes verified", flush=True)
    return {"files_checked": report.files_checked, "bytes_checked": report.bytes_checked}

"""verify: recompute every checksum and check structure; non-zero exit naming every problem."""

from __future__ import annotations

from ..dcp.errors import CorruptCheckpointError
from ..dcp.inspection import verify
from .context import JobContext


def run(ctx: JobContext) -> dict:
    if ctx.info.rank != 0:
        return {}
    done = [0, 0]

    def on_file(name: str, size: int) -> None:
        done[0] += size
        done[1] += 1

    with ctx.metrics.phase("verify"), ctx.byte_progress("verify", lambda: (done[0], done[1])):
        report = verify(ctx.checkpoint_path(), on_file=on_file)
    if not report.ok:
        raise CorruptCheckpointError(f"{report.path}: {len(report.problems)} problem(s):\n  - "
                                     + "\n  - ".join(report.problems))
    print(f"OK: {report.path}: {report.files_checked} files, {report.bytes_checked} bytes verified", flush=True)
    return {"files_checked": report.files_checked, "bytes_checked": report.bytes_checked}

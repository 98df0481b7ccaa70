"""verify: recompute every checksum and check structure; non-zero exit naming every problem.

A Hugging Face or torch DCP checkpoint (``job.source.format``) has no checksums of ours: its
structure is validated (index against shard headers, bounds, overlaps, tiling, files, a torch DCP
record's zip structure) and every tensor byte is read once. torch DCP records carry a zip CRC-32,
checked for every record read whole (verify reads each whole), as are the tensors of a
``torch.save`` archive (DeepSpeed's, Megatron-LM's legacy format) that fill their storage (a part
of one, as a ZeRO partition's parameter, cannot be); Hugging Face files record none,
so a flipped bit in their data is detected only where the store keeps a digest of the whole
file (S3 and GCS MD5 ETags, Azure's Content-MD5; ``dcp.storage.store_digests``), which verify,
reading every byte, checks.
"""

from __future__ import annotations

from ..dcp import CorruptCheckpointError
from ..dcp.tools import full_tensor_digests, verify
from ..runtime import write_out
from .context import JobContext


def run(ctx: JobContext) -> dict:
    if ctx.info.rank != 0:
        return {}
    job = ctx.cfg.job
    path = ctx.abspath(job.source.path) if job.source.path else ctx.checkpoint_path()
    key = "job.source.path" if job.source.path else "checkpoint.path"
    reader = ctx.reader(path, foreign=True)
    if reader.format_name != "hpdcp":
        with ctx.metrics.phase("verify"), ctx.user_errors(key):
            n = len(full_tensor_digests(path, reader))
        crcs = reader.counters.chunks_verified
        states = reader.files.store_digest_states()
        stored = sum(s == "matched" for s in states.values())
        how = [f"{crcs} records matched their zip CRC-32"] if crcs else []
        if stored:
            how.append(f"{stored} object(s) matched the store's MD5")
        unchecked = sorted(name for name, s in states.items() if s in ("unusable", "skipped"))
        if unchecked:
            how.append(f"not checked against the store's digest: {', '.join(unchecked)}")
        if not how:
            how = ["this format records no checksums (nor does this storage), so flipped bits cannot be detected"]
        write_out(f"OK: {path} ({reader.format_name}): structure valid, {n} tensors read in full; {'; '.join(how)}")
        return {"checkpoint": path, "tensors_read": n, "format": reader.format_name, "checksums": bool(crcs or stored),
                "records_crc_checked": crcs, "store_digests_matched": stored}
    reader.close()
    with ctx.metrics.phase("verify"), ctx.bars.bytes_bar(f"verify {path}") as bar, ctx.user_errors(key):
        report = verify(path, on_bytes=bar)
    if not report.ok:
        raise CorruptCheckpointError(f"{report.path}: {len(report.problems)} problem(s):\n  - "
                                     + "\n  - ".join(report.problems))
    write_out(f"OK: {report.path}: {report.files_checked} files, {report.bytes_checked} bytes verified")
    return {"checkpoint": path, "files_checked": report.files_checked, "bytes_checked": report.bytes_checked}

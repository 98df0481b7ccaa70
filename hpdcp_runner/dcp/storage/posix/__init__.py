"""Checkpoints in a local (or shared POSIX) directory: the writer (``filesystem``), the rename
commit and its recovery (``commit``), and a load's files pinned by a directory descriptor
(``posix_files``)."""

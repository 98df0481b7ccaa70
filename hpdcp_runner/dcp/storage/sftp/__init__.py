"""Checkpoints on a file server reached over SSH (``sftp://host[:port]/absolute/path``): a store of
the registry whose client (:mod:`.client`) gives the store protocol its two conditional writes
from what an SFTP server does on its own file system."""

"""Checkpoints in a store: the commit-object protocol every store kind keeps
(``object_checkpoint``), a load's files fetched by ranges (``object_files``, ``object_reader``),
the stores' own digests of foreign files (``store_digests``), and obstore's cloud client
(``object_store``: S3, GCS, Azure). Other store kinds bring their own client beside this package
(``storage/sftp``)."""

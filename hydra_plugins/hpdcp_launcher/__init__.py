"""Hydra launcher plugin: ``hydra/launcher=hpdcp_torchrun`` runs every sweep point as its own
distributed job of ``nproc_per_node`` torch workers (torch's ``elastic_launch``)."""

"""Formats other tools wrote, read in place on any location: Hugging Face and torch DCP
(``foreign``, with the one format detector), DeepSpeed (``deepspeed*``), Megatron
(``megatron*``), and what they share (``format_marks``, ``torch_archive``)."""

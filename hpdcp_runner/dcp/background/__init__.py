"""Saves that finish in the background, and the copies made after them.

* ``saver``: ``async_save`` — the state copied to the host (``host_copies``, reused between saves),
  then persisted by the ordinary save protocol in a background thread on a gloo group of its own;
* ``process``: ``async_save(mode="process")`` — the host copies in shared memory and a persisting
  process per rank that writes them, so serialising and hashing never take the training GIL;
* ``drain``: a committed checkpoint copied, verified, to another store (a fast tier drained to a
  durable one) and committed there.
"""

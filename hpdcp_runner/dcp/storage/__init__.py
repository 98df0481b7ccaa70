"""Layer 3: storage interfaces, the filesystem reader/writer, the commit step, retention,
foreign-format readers."""

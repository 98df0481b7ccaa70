"""Layer 0: errors, logging/utilities, fault points, box geometry, int columns, ragged shards."""

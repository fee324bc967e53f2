"""chunkline."""

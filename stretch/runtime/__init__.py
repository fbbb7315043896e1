"""Node engine internals: shared-memory segments, gates, workers, coordinator. Not public API."""

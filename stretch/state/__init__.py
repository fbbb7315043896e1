"""Keyed state: key groups, shared-memory state tables, timers, snapshots."""

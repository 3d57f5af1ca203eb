"""Appending planned records to Redis streams exactly once: batching, backpressure, partition leases and dead letters (no HTTP)."""

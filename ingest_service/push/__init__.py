"""HTTP push ingestion's core: bounded bodies, the exactly-once append script, the ack ledger, its Redis pool and durability watch."""

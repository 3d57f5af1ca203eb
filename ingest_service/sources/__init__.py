"""Where records come from: files, Hugging Face, WebDataset and token shards, planned into partition chunks (no Redis, no HTTP)."""

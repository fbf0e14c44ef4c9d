"""One stage shard on its device: the stage worker, sampling, device and backend choice."""

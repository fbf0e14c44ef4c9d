"""Executors run micro-batches on stage workers: `local` (all stages in this process)."""

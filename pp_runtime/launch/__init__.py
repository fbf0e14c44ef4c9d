"""Process entry points for launchers (torchrun)."""

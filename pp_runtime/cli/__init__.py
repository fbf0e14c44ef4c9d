"""The command line (`pp-runtime`): one module per command, and the torchrun entry points."""

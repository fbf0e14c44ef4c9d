"""The errors a user can cause, in a module with no imports so every layer can raise them."""


class ConfigError(ValueError):
    """A configuration that cannot work. The message names the field and the fix."""


class CheckpointError(ValueError):
    """A checkpoint that does not match its config or cannot be read."""


class WorkerFailed(RuntimeError):
    """A stage worker died, raised, or hung; the message names its stage and TP rank."""


class StartCancelled(RuntimeError):
    """The workers' start was given up because the process is stopping (a server's signal)."""

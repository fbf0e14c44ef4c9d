"""Telemetry: bubble accounting (more reports come with the simulator)."""

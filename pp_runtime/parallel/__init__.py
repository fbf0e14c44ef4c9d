"""Process groups, tensor-parallel layers and stage-to-stage transfers."""

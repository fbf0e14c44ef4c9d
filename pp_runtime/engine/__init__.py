"""What runs the pipeline for a caller: the online engine, request streams, `LLM`, the simulation run."""

"""The vLLM peer: run the same requests through vLLM (its own virtual environment) and compare."""

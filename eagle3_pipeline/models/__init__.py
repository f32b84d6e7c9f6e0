"""The verifier and the draft as vLLM reads them, and vLLM's acceptance rule."""

"""Stages 05 and 06: the vLLM export behind its gate, acceptance measured."""

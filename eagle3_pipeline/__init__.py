"""EAGLE-3 draft-head pipeline for Kimi-K2.5, served by vLLM.

The numbered stage scripts at the repository root are thin: they parse flags, resolve the config and
call one module here. Importing this package is cheap (no torch); modules import what they need.
"""

__version__ = "0.1.0"

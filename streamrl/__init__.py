"""streamrl: fully asynchronous, streaming reinforcement learning for LLMs.

Importing the package loads nothing heavy (no torch, Megatron or SGLang);
components import what they need when they run.
"""

__version__ = "0.1.0"

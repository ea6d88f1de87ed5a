"""Diffusion and RLHF building blocks: pure functions and loops on top of the engine registry."""

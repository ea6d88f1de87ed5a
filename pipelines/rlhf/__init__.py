"""RLHF building blocks, DeepSpeed-Chat steps 1-3 (roles: actor, critic, ref, reward, ema)."""

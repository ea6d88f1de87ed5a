"""Diffusion fine-tuning building blocks (roles: unet, vae, text_encoder, ema)."""

"""Diffusion fine-tuning building blocks (roles: unet, vae, text_encoder[_2...], ema).

math.py        noise targets, SNR, min-SNR weights, offset noise, input perturbation, loss (pure functions)
data.py        generated shapes dataset, image-caption loading, transforms, collation, resumable sampler
tiny.py        a tiny SD folder built offline (and its vae pretraining)
models.py      role specs / registry for unet, vae, text encoders and EMA; zero3 and seed_baseline modes
training.py    the training step (latents, conditioning, noise, timesteps, target, loss) and held-out loss
validation.py  a pipeline on the engines' modules, images on all ranks in lockstep, grids
export.py      diffusers pipeline folder, per-role folders, LoRA weights
"""

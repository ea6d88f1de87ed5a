"""Diffusion fine-tuning building blocks (roles: unet/transformer, vae, text_encoder[_2, _3], controlnet, ema).

math.py        noise targets, SNR, min-SNR weights, offset noise, input perturbation, loss (pure functions)
flow.py        flow matching (SD3/FLUX): timestep densities, loss weightings, schedule, FLUX packing (pure functions)
families.py    sd / sdxl / sd3 / flux from model_index.json, and each family's role names
controlnet.py  a ControlNet initialised from a unet
data.py        generated shapes dataset, image-caption loading, transforms, collation, resumable sampler
tiny.py        tiny SD / SDXL / SD3 / FLUX folders built offline (and the vae pretraining)
models.py      role specs / registry for unet, vae, text encoders and EMA; zero3 and seed_baseline modes
training.py    the training steps (DDPM, ControlNet, flow matching) and held-out losses
validation.py  a pipeline on the engines' modules, images on all ranks in lockstep, grids
export.py      diffusers pipeline folder, per-role folders, LoRA weights
planning.py    the memory planner's view of a pipeline: family, tiny models, activation peaks
"""

"""Diffusion fine-tuning and RL building blocks (roles: unet/transformer, vae, text_encoder[_2, _3], controlnet, ema,
policy, ref, reward), each section of a recipe's config a settings dataclass here, handed whole to its consumer.

math.py, flow.py  DDPM and flow-matching math (pure functions)
families.py       sd / sdxl / sd3 / flux from model_index.json, and each family's role names
models.py         the model and EMA settings, components of a diffusers folder, the EMA update
training.py       the objectives (DDPM, ControlNet, flow matching), their settings and held-out losses
data.py, inputs.py  the shapes data, image-caption loading and checks; the data section (ImageData)
runs.py           the training stream, the tiny model, validation images, memory figures
validation.py, export.py, controlnet.py, tiny.py, planning.py  validation pipelines, exports, the ControlNet,
                  tiny models, the planner's view
rl.py, rl_runs.py, rewards.py  diffusion RL (DDPO / Flow-GRPO, Diffusion-DPO): math, settings, policy model, rewards"""

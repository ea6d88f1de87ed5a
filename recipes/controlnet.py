"""ControlNet training with every model sharded: a trainable ControlNetModel initialised from the unet, the
frozen unet beside it at ZeRO-3 (each rank holds 1/N of it, where diffusers' train_controlnet.py keeps a whole
copy on every GPU), the frozen vae and text encoder(s); each its own DeepSpeed engine.

    multiengine run controlnet --config tiny --nproc-per-node 2                  # tiny SD, shapes + edge maps
    multiengine run controlnet --config tiny --nproc-per-node 2 data.conditioning_kind=mask
    multiengine run controlnet --config sd15_canny --nproc-per-node 8            # SD 1.5, fill50k (GPUs)

The conditioning images come from a dataset column (``data.columns.conditioning_image``, default
``conditioning_image``; an imagefolder's ``conditioning_image_file_name`` in metadata.jsonl loads as it). The
built-in data is the shapes dataset with an edge or mask image per picture. The loss is diffusers'
``train_controlnet.py`` step (:class:`ControlNetObjective`): the controlnet's residuals go into the frozen unet,
whose noise prediction is compared with the noise; the gradient reaches the controlnet through the unet.
``mode=seed_baseline`` builds the frozen roles whole on every rank, as the diffusers script does. Writes
metrics.jsonl, summary.json, validation grids (conditioning image beside each generation), checkpoints,
export/controlnet (ControlNetModel.from_pretrained) and export/pipeline (StableDiffusionControlNetPipeline).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from multiengine.engines import frozen_role, trainable_role
from multiengine.pipelines.diffusion import data as data_lib
from multiengine.pipelines.diffusion.controlnet import controlnet_factory
from multiengine.pipelines.diffusion.export import export_pipeline, export_roles
from multiengine.pipelines.diffusion.models import SEED_BASELINE, load_component
from multiengine.pipelines.diffusion.training import ControlNetObjective
from multiengine.pipelines.diffusion.validation import build_pipeline, image_grid
from multiengine.recipes import sd_finetune as sd
from multiengine.recipes.common import placement
from multiengine.engines.recipe_config import Choice, Each, Range, RecipeConfigError, config_problem
from multiengine.recipes.lifecycle import COMMON_DEFAULTS
from multiengine.recipes.sd_finetune import (
    DATA_DEFAULTS,
    EVAL_DEFAULTS,
    TRAIN_DEFAULTS,
    VALIDATION_DEFAULTS,
    Removed,
)
from PIL import Image

logger = logging.getLogger(__name__)

# ControlNet pipelines per base family (diffusers' ControlNetModel conditions a unet: SD 1.x/2.x and SDXL).
CONTROLNET_PIPELINES = {"sd": "StableDiffusionControlNetPipeline", "sdxl": "StableDiffusionXLControlNetPipeline"}

KEYS: dict[str, Any] = {
    **COMMON_KEYS,
    "output_dir": "outputs/controlnet",
    "max_steps": Key(100, "optimizer steps"),
    "mode": Key("zero3", "zero3 (every role as in roles.*) | seed_baseline (frozen unet, vae, text encoders whole)"),
    "model": Key({
        "pretrained": Key("", "diffusers SD or SDXL folder or hub name; \"\" = the tiny model of model.tiny_family"),
        "revision": Key("", "hub revision (\"\" = main)"),
        "variant": Key("", "weight variant passed to from_pretrained (e.g. fp16)"),
        "controlnet": Key("", "a ControlNetModel folder to continue training; \"\" = initialised from the unet"),
        "tiny_family": Key("sd", "tiny model only: sd | sdxl"),
        "tiny_vae_steps": Key(0, "tiny model only: pretrain its random vae on the training images first"),
    }, "the base model and the ControlNet"),
    "data": Key({
        **DATA_DEFAULTS,
        "columns": Key({"image": Key("", "your column names (\"\" = the defaults)"), "caption": Key("", "your column names (\"\" = the defaults)"), "conditioning_image": Key("", "your column names (\"\" = the defaults)")}, "your "
                                                                                                                                                                                                                               "column "
                                                                                                                                                                                                                               "names "
                                                                                                                                                                                                                               "(\"\" "
                                                                                                                                                                                                                               "= "
                                                                                                                                                                                                                               "the "
                                                                                                                                                                                                                               "defaults)"),
        "conditioning_kind": Key("edge", "built-in shapes data: edge (outline) or mask (filled shape) images"),
    }, "image-caption rows with a conditioning image each (docs/data.md)"),
    "train": Key({**TRAIN_DEFAULTS}, "the controlnet's optimisation (DDPM loss through the frozen unet)"),
    "controlnet": Key({
        "conditioning_scale": Key(1.0, "multiplies the controlnet's residuals (1 in diffusers' training)"),
    }, "how the conditioning enters"),
    "roles": Key({
        "controlnet": Key({"stage": Key(3, "trained"), "dtype": Key("bf16", "trained"), "offload_params": Key(False, "trained"), "offload_optimizer": Key(False, "trained")}, "trained"),
        "unet": Key({"stage": Key(3, "frozen; its backward reaches the controlnet"), "dtype": Key("bf16", "frozen; its backward reaches the controlnet"), "offload_params": Key(False, "frozen; its backward reaches the controlnet")}, "frozen; "
                                                                                                                                                                                                                                        "its "
                                                                                                                                                                                                                                        "backward "
                                                                                                                                                                                                                                        "reaches "
                                                                                                                                                                                                                                        "the "
                                                                                                                                                                                                                                        "controlnet"),
        "vae": Key({"stage": Key(3, "frozen vae"), "dtype": Key("bf16", "frozen vae"), "offload_params": Key(False, "frozen vae"), "gather_forward": Key(True, "frozen vae")}, "frozen "
                                                                                                                                                                               "vae"),
        "text_encoder": Key({"stage": Key(3, "frozen"), "dtype": Key("bf16", "frozen"), "offload_params": Key(False, "frozen"), "gather_forward": Key(True, "frozen")}, "frozen"),
        "text_encoder_2": Key({"stage": Key(-1, "SDXL's second"), "dtype": Key("", "SDXL's second"), "offload_params": Key(False, "SDXL's second"), "gather_forward": Key(True, "SDXL's second")}, "SDXL's "
                                                                                                                                                                                                   "second"),
    }, "placement per role"),
    "validation": Key({**VALIDATION_DEFAULTS}, "generations from held-out conditioning images and captions"),
    "eval": Key({**EVAL_DEFAULTS}, "held-out loss at fixed noise and timesteps"),
    "export": Key({
        "enabled": Key(True, "export/controlnet and export/pipeline"),
        "dtype": Key("fp32", "dtype of every exported component (copied ones are cast too)"),
        "roles": Key([], "further per-role folders, e.g. [unet] ([] = none)"),
    }, "outputs under output_dir/export"),
}

HELP = {f"roles.{r}.{k}": text for r, section in DEFAULTS["roles"].items() for k, text in sd.ROLE_KEY_HELP.items()
        if k in section}
HELP.update({"roles.text_encoder_2.stage": "ZeRO stage; -1 = as roles.text_encoder",
             "roles.text_encoder_2.dtype": "fp32 | bf16 | fp16; \"\" = as roles.text_encoder"})

_STAGE = Range(0, 3)
_DTYPE = Choice("fp32", "bf16", "fp16")
CHECKS = {
    **{k: v for k, v in sd.CHECKS.items() if k.split(".")[0] in ("max_steps", "mode", "seed", "data", "train",
                                                                 "validation", "eval", "checkpoint")},
    "model.tiny_family": Choice(*CONTROLNET_PIPELINES),
    "model.tiny_vae_steps": Range(0),
    "data.conditioning_kind": Choice(*data_lib.CONDITIONING_KINDS),
    "controlnet.conditioning_scale": Range(0),
    "roles.controlnet.stage": _STAGE,
    "roles.unet.stage": _STAGE,
    "roles.vae.stage": _STAGE,
    "roles.text_encoder.stage": _STAGE,
    "roles.text_encoder_2.stage": Range(-1, 3),
    "roles.controlnet.dtype": _DTYPE,
    "roles.unet.dtype": _DTYPE,
    "roles.vae.dtype": _DTYPE,
    "roles.text_encoder.dtype": _DTYPE,
    "roles.text_encoder_2.dtype": Choice("", "fp32", "bf16", "fp16"),
    "export.dtype": _DTYPE,
    "export.roles": Each(Choice("controlnet", "unet", "vae", "text_encoder", "text_encoder_2")),
}
assert not any(isinstance(c, Removed) for c in CHECKS.values())


def validate(cfg: Any, world_size: int = 1) -> None:
    """Before any rank starts: the base model folder is SD or SDXL, the ControlNet folder (if any) exists, the
    data has images, captions and conditioning images, enough rows (a micro batch per rank on ``world_size``
    ranks), every image readable."""
    from multiengine.pipelines.checks import check_diffusers_folder, check_model_folder
    from multiengine.pipelines.diffusion.families import model_family

    family = str(cfg.model.tiny_family)
    if cfg.model.pretrained:
        path = str(cfg.model.pretrained)
        try:
            if check_model_folder(path, "model.pretrained", kind="diffusers") == "local":
                check_diffusers_folder(path, "model.pretrained")
                family = model_family(os.path.expanduser(path))
            else:
                family = ""
        except (ValueError, FileNotFoundError) as exc:
            raise config_problem("model.pretrained", path, "is not a usable diffusers folder", str(exc)) from None
        if family and family not in CONTROLNET_PIPELINES:
            raise config_problem("model.pretrained", path, f"is a {family} model; a ControlNet conditions a unet "
                                 f"({', '.join(CONTROLNET_PIPELINES)})", "give an SD 1.x/2.x or SDXL folder")
    if cfg.model.controlnet:
        path = os.path.expanduser(str(cfg.model.controlnet))
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise config_problem("model.controlnet", cfg.model.controlnet, "is not a ControlNetModel folder (no "
                                 "config.json)", "give a folder saved with ControlNetModel.save_pretrained, or ''")
    if family:
        sd.validate_resolution(cfg, family, str(cfg.model.pretrained))
    sd.check_data(cfg, conditioning=True)
    sd.check_batches(cfg, world_size, conditioning=True)


class ControlNetTraining(sd.SDFinetune):
    """The SD fine-tune lifecycle with a trainable ``controlnet`` in front of a frozen ``unet``."""

    name = "controlnet"
    conditioning = True

    @property
    def trained(self) -> str:
        return "controlnet"

    @property
    def conditioning_column(self) -> str:
        return str(self.cfg.data.columns.conditioning_image or "conditioning_image")

    def make_builtin_data(self, folder: str) -> None:
        cfg = self.cfg
        data_lib.make_shapes_controlnet_dataset(folder, cfg.data.builtin_size, cfg.data.resolution, seed=cfg.seed,
                                                kind=cfg.data.conditioning_kind)

    def add_roles(self) -> None:
        cfg, t, registry = self.cfg, self.cfg.train, self.registry
        if self.family not in CONTROLNET_PIPELINES:
            raise RecipeConfigError(f"model.pretrained={self.model_path!r} is a {self.family} model; the controlnet "
                                    f"recipe trains a ControlNet for a unet ({', '.join(CONTROLNET_PIPELINES)}).")
        roles = cfg.roles
        seed_layout = cfg.mode == SEED_BASELINE
        first = placement(roles.text_encoder, trainable=False)
        frozen = {"unet": placement(roles.unet, trainable=False), "vae": placement(roles.vae, trainable=False)}
        for name in self.text_encoders:
            frozen[name] = first if name == "text_encoder" else placement(roles[name], follow=first, trainable=False)
        if seed_layout:  # diffusers' train_controlnet.py: only the trained model goes through DeepSpeed's ZeRO
            from multiengine.engines import Placement

            frozen = {name: Placement(stage=0, dtype=p.dtype) for name, p in frozen.items()}
        variant = sd._cfg_str(cfg.model.variant)
        factory = controlnet_factory(self.model_path, seed=cfg.seed, variant=variant,
                                     controlnet_path=sd._cfg_str(cfg.model.controlnet))
        registry.add(trainable_role("controlnet", factory, placement(roles.controlnet), self.optim_spec(),
                                    micro_batch_size=t.micro_batch_size, grad_accum=t.grad_accum,
                                    gradient_checkpointing=t.gradient_checkpointing, seed=cfg.seed))
        for name, place in frozen.items():
            registry.add(frozen_role(name, _component(self.model_path, name, variant), place))

    def make_objective(self) -> Any:
        from diffusers import DDPMScheduler

        cfg, t = self.cfg, self.cfg.train
        scheduler = DDPMScheduler.from_pretrained(self.model_path, subfolder="scheduler")
        self.prediction_type = t.prediction_type or scheduler.config.prediction_type
        return ControlNetObjective(
            self.registry, self.text_encoders, scheduler.alphas_cumprod, prediction_type=self.prediction_type,
            snr_gamma=t.snr_gamma, noise_offset=t.noise_offset, input_perturbation=t.input_perturbation,
            resolution=cfg.data.resolution, conditioning_scale=cfg.controlnet.conditioning_scale)

    def load_rows(self) -> Any:
        cfg = self.cfg
        columns = {k: v for k, v in sd.data_columns(cfg).items() if k != "conditioning_image"}
        return data_lib.load_image_caption_data(
            self.data_source, columns=columns, image_column=str(cfg.data.image_column),
            caption_column=str(cfg.data.caption_column), train_split=str(cfg.data.train_split),
            eval_source=sd._plain(cfg.data.eval_source) or None, eval_split=sd.eval_split_value(cfg), seed=cfg.seed,
            cache_dir=sd._cfg_str(cfg.data.cache_dir), extra_images={"conditioning_image": self.conditioning_column})

    def make_dataset(self, rows: Any, transform: Any) -> Any:
        return data_lib.ConditionedImageCaptionDataset(rows, transform, "image", "caption", "conditioning_image",
                                                       seed=self.cfg.seed)

    def validation_prompts(self, rows: Any) -> list[str]:
        """The first ``validation.num_prompts`` held-out rows: their captions (or validation.prompts, one per
        row) and their conditioning images, resized and center-cropped like training images."""
        cfg = self.cfg
        n = min(len(rows), len(cfg.validation.prompts) or cfg.validation.num_prompts)
        transform = data_lib.ImageTransform(cfg.data.resolution, center_crop=True, random_flip=False)
        self.conditions = []
        captions = []
        for i in range(n):
            row = rows[i]
            image = row["conditioning_image"].convert("RGB")
            _, params = transform.apply(row["image"])
            pixels = transform.replay(image, params, params["original_size"])
            self.conditions.append(Image.fromarray(
                (pixels.permute(1, 2, 0).numpy() * 255).round().astype("uint8")))
            caption = row["caption"][0] if isinstance(row["caption"], (list, tuple)) else row["caption"]
            captions.append(str(caption))
        if cfg.validation.prompts:
            return [str(p) for p in cfg.validation.prompts][:n]
        return captions

    def validation_pipeline(self, role: str) -> Any:
        return build_pipeline(self.registry, self.model_path, self.text_encoders, "unet", self.prediction_type,
                              denoiser="unet", components={"controlnet": role},
                              class_name=CONTROLNET_PIPELINES[self.family])

    def validation_role(self) -> str:
        return "controlnet"

    def pipeline_kwargs(self) -> dict[str, Any]:
        return {"image": list(self.conditions),
                "controlnet_conditioning_scale": float(self.cfg.controlnet.conditioning_scale)}

    def grid(self, images: list[Any]) -> Any:
        """Each conditioning image beside its generation, one row per prompt."""
        cells, labels = [], []
        for cond, image, prompt in zip(self.conditions, images, self.prompts):
            cells += [cond, image]
            labels += [f"{self.cfg.data.conditioning_kind if self.builtin_data else 'conditioning'} image", prompt]
        return image_grid(cells, cols=2, prompts=labels, step=self.step)

    def export(self) -> dict[str, Any]:
        cfg, registry = self.cfg, self.registry
        if not cfg.export.enabled:
            return {}
        written = export_roles(registry, self.path("export"), ["controlnet"], dtype=cfg.export.dtype)
        # The frozen components are unchanged: copied from the source folder (cast to export.dtype), not gathered.
        written["pipeline"] = export_pipeline(registry, self.model_path, self.path("export", "pipeline"),
                                              {"controlnet": "controlnet"}, dtype=cfg.export.dtype,
                                              prediction_type=self.prediction_type,
                                              class_name=CONTROLNET_PIPELINES[self.family], cast_copied=True)
        extra = [r for r in cfg.export.roles if r != "controlnet"]
        missing = [r for r in extra if r not in registry]
        if missing:
            raise RecipeConfigError(f"export.roles={list(cfg.export.roles)}: {missing} not among this run's roles")
        written.update(export_roles(registry, self.path("export"), extra, dtype=cfg.export.dtype))
        return written

    def summary_extra(self) -> dict[str, Any]:
        out = super().summary_extra()
        out.update({"conditioning_column": self.conditioning_column, "pipeline": CONTROLNET_PIPELINES[self.family]})
        if self.builtin_data:
            out["conditioning_kind"] = self.cfg.data.conditioning_kind
        return out


def _component(path: str, name: str, variant: str | None):
    return lambda: load_component(path, name, variant)


main = ControlNetTraining.main

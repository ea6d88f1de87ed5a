"""ControlNet training with every model sharded: a trainable ControlNetModel initialised from the unet, the
frozen unet beside it at ZeRO-3 (1/N per rank, where diffusers' train_controlnet.py keeps a whole copy on every
GPU), the frozen vae and text encoder(s); each its own DeepSpeed engine.

    multiengine run controlnet --config tiny --nproc-per-node 2                  # tiny SD, shapes + edge maps
    multiengine run controlnet --config tiny --nproc-per-node 2 data.conditioning_kind=mask

The conditioning images come from ``data.columns.conditioning_image`` (the built-in shapes data: an edge or mask
image per picture). The loss is train_controlnet.py's step: the controlnet's residuals go into the frozen unet,
whose noise prediction is compared with the noise; the gradient reaches the controlnet through the unet.
``mode=seed_baseline`` builds the frozen roles whole on every rank. Writes what sd_finetune writes, with the
conditioning image beside each validation image, export/controlnet and export/pipeline (docs/diffusion.md).
"""

from __future__ import annotations

from typing import Any

from multiengine.engines.recipe_config import (
    Choice,
    Each,
    Key,
    Satisfies,
    config_problem,
    split_keys,
)
from multiengine.engines.recipe_lifecycle import COMMON_KEYS
from multiengine.engines.role_schema import Role, optim_spec, placement, role_keys
from multiengine.pipelines.diffusion import data as data_lib
from multiengine.pipelines.diffusion.controlnet import CONTROLNET_PIPELINES, controlnet_role_specs
from multiengine.pipelines.diffusion.export import export_run
from multiengine.pipelines.diffusion.inputs import check_config_folder
from multiengine.pipelines.diffusion.models import MODES
from multiengine.pipelines.diffusion.runs import conditioning_rows
from multiengine.pipelines.diffusion.validation import build_pipeline, image_grid
from multiengine.recipes import diffusion_keys as shared
from multiengine.recipes import plans
from multiengine.recipes.sd_finetune import SDFinetune

ROLES = (
    Role("controlnet", "the ControlNet, trained; model \"\" = initialised from the unet (diffusers' "
         "ControlNetModel.from_unet), or a ControlNetModel folder to continue training", trainable=True,
         keys={**shared.TRAINED, "model": Key("", "a ControlNetModel folder (save_pretrained); \"\" = initialised "
                                                  "from the unet")}),
    Role("unet", "frozen; its backward carries the gradient to the controlnet",
         keys={"dtype": "fp32", "model": shared.component_model("unet")}),
    *shared.component_roles("frozen: SDXL's CLIP-G"),
)
KEYS: dict[str, Any] = {
    **COMMON_KEYS,
    "output_dir": Key("outputs/controlnet", "everything the run writes goes under this folder"),
    "max_steps": Key(200, "optimizer steps"),
    "mode": Key("zero3", "zero3 (every role as in roles.*) | seed_baseline (frozen unet, vae, text encoders whole)",
                Choice(*MODES)),
    "model": Key({**shared.MODEL_KEYS, "tiny_family": Key("sd", "tiny model only: sd | sdxl",
                                                           Choice(*CONTROLNET_PIPELINES))},
                 "the base SD or SDXL pipeline folder"),
    "roles": role_keys(ROLES),
    "diffusion": Key({"adam_epsilon": Key(1e-8, "AdamW epsilon of the controlnet"), **shared.DDPM_KEYS},
                     "the objective: diffusers' train_controlnet.py DDPM loss through the frozen unet"),
    "data": Key({
        **shared.SD_DATA_KEYS,
        "columns": Key({**shared.SD_DATA_KEYS["columns"].default, "conditioning_image": Key(
            "", "your conditioning image column (\"\" = conditioning_image)")}, "your column names per field"),
        "conditioning_kind": Key("edge", "built-in shapes data: edge (outline) or mask (filled shape) images",
                                 Choice(*data_lib.CONDITIONING_KINDS)),
    }, "image-caption rows with a conditioning image each (docs/data.md)"),
    "controlnet": Key({
        "conditioning_scale": Key(1.0, "multiplies the controlnet's residuals (1 in diffusers' training)"),
    }, "how the conditioning enters"),
    "validation": Key({k: v for k, v in shared.VALIDATION_KEYS.items() if k != "use_ema"},
                      "generations from held-out conditioning images and captions"),
    "eval": shared.EVAL_KEYS,
    "export": Key({
        "enabled": Key(True, "export/controlnet and export/pipeline"),
        "dtype": Key("fp32", "dtype of every exported component (copied ones are cast too)"),
        "roles": Key([], "further per-role folders, e.g. [unet] ([] = none)", Each(Choice(*(r.name for r in ROLES)))),
    }, "outputs under output_dir/export"),
}
DEFAULTS, HELP = split_keys(KEYS)
CHECKS = {"roles.controlnet.lora.r": Satisfies(lambda v: v == 0, "0: the controlnet trains in full (no LoRA)")}
RENAMED = {**shared.renamed("controlnet"), "model.controlnet": "roles.controlnet.model"}


def check_unet_family(family: str, pretrained: str) -> None:
    """A ControlNet conditions a unet: the base model's family ("" = not known yet) is SD or SDXL."""
    if family and family not in CONTROLNET_PIPELINES:
        raise config_problem("model.pretrained", pretrained, f"is a {family} model; a ControlNet conditions a unet "
                             f"({', '.join(CONTROLNET_PIPELINES)})", "give an SD 1.x/2.x or SDXL folder")


def validate(cfg: Any, world_size: int = 1) -> None:
    """Before any rank starts: the base model folder is SD or SDXL, the ControlNet folder (if any) exists, the
    data has images, captions and conditioning images, enough rows (a micro batch per rank on ``world_size``
    ranks), every image readable."""
    check_unet_family(shared.check_model(cfg, tuple(r.name for r in ROLES[1:])), str(cfg.model.pretrained))
    check_config_folder("roles.controlnet.model", str(cfg.roles.controlnet.model), "a ControlNetModel folder",
                        "give a folder saved with ControlNetModel.save_pretrained, or \"\"")
    shared.check_data(cfg, world_size, "controlnet", conditioning=True)


class ControlNetTraining(SDFinetune):
    """The SD fine-tune lifecycle with a trainable ``controlnet`` in front of a frozen ``unet``."""

    name = "controlnet"
    conditioning = True
    trained_role = "controlnet"

    def check_family(self, where: str) -> None:
        check_unet_family(self.family, where)

    def make_builtin_data(self, folder: str) -> None:
        cfg = self.cfg
        data_lib.make_shapes_controlnet_dataset(folder, cfg.data.builtin_size, cfg.data.resolution, seed=cfg.seed,
                                                kind=cfg.data.conditioning_kind)

    def add_roles(self) -> None:
        cfg, c = self.cfg, self.cfg.roles.controlnet
        frozen = ("unet", "vae", *self.text_encoders)
        for spec in controlnet_role_specs(
            self.model_path, {name: placement(cfg, ROLES, name) for name in ("controlnet", *frozen)},
            optim_spec(cfg, "controlnet", cfg.max_steps, eps=float(cfg.diffusion.adam_epsilon)), mode=cfg.mode,
            frozen=frozen, controlnet_path=str(c.model) or None, micro_batch_size=c.micro_batch_size,
            grad_accum=c.grad_accum, gradient_checkpointing=c.gradient_checkpointing, seed=cfg.seed,
            variant=str(cfg.model.variant) or None,
        ):
            self.registry.add(spec)

    def make_objective(self, **extra: Any) -> tuple[Any, str | None]:
        return super().make_objective(conditioning_scale=float(self.cfg.controlnet.conditioning_scale))

    def make_dataset(self, rows: Any, transform: Any) -> Any:
        return data_lib.ConditionedImageCaptionDataset(rows, transform, "image", "caption", "conditioning_image",
                                                       seed=self.cfg.seed)

    def validation_prompts(self, rows: Any) -> list[str]:
        """The first ``validation.num_prompts`` held-out rows: their captions (or validation.prompts, one per
        row) and their conditioning images, resized and center-cropped like training images."""
        v = self.cfg.validation
        self.conditions, captions = conditioning_rows(rows, len(v.prompts) or v.num_prompts, self.cfg.data.resolution)
        return [str(p) for p in v.prompts][:len(captions)] if v.prompts else captions

    def validation_pipeline(self, role: str) -> Any:
        return build_pipeline(self.registry, self.model_path, self.text_encoders, "unet", self.prediction_type,
                              denoiser="unet", components={"controlnet": role},
                              class_name=CONTROLNET_PIPELINES[self.family])

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
        cfg = self.cfg
        if not cfg.export.enabled:
            return {}
        # The frozen components are unchanged: copied from the source folder (cast to export.dtype), not gathered.
        return export_run(self.registry, self.path("export"), self.model_path, {"controlnet": "controlnet"},
                          dtype=cfg.export.dtype, prediction_type=self.prediction_type, first=["controlnet"],
                          roles=list(cfg.export.roles), class_name=CONTROLNET_PIPELINES[self.family], cast_copied=True)

    def summary_extra(self) -> dict[str, Any]:
        out = super().summary_extra()
        out.update({"conditioning_column": str(self.cfg.data.columns.conditioning_image or "conditioning_image"),
                    "pipeline": CONTROLNET_PIPELINES[self.family]})
        if self.builtin_data:
            out["conditioning_kind"] = self.cfg.data.conditioning_kind
        return out


main = ControlNetTraining.main
plan = plans.controlnet  # what `multiengine plan` sees of this recipe

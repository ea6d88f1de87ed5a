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

from multiengine.engines import Placement, frozen_role, trainable_role
from multiengine.engines.recipe_config import (
    Choice,
    Each,
    Key,
    RecipeConfigError,
    Satisfies,
    config_problem,
    split_keys,
)
from multiengine.engines.recipe_lifecycle import COMMON_KEYS
from multiengine.engines.role_schema import Role, optim_spec, placement, role_keys
from multiengine.pipelines.diffusion import data as data_lib
from multiengine.pipelines.diffusion.controlnet import CONTROLNET_PIPELINES, controlnet_factory
from multiengine.pipelines.diffusion.export import export_run
from multiengine.pipelines.diffusion.inputs import check_config_folder, check_resolution, model_folder_family
from multiengine.pipelines.diffusion.models import MODES, SEED_BASELINE, load_component
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
        "columns": Key({"image": Key("", "your image column (\"\" = data.image_column)"),
                        "caption": Key("", "your caption column (\"\" = data.caption_column)"),
                        "conditioning_image": Key("", "your conditioning image column (\"\" = conditioning_image)")},
                       "your column names per field"),
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


def validate(cfg: Any, world_size: int = 1) -> None:
    """Before any rank starts: the base model folder is SD or SDXL, the ControlNet folder (if any) exists, the
    data has images, captions and conditioning images, enough rows (a micro batch per rank on ``world_size``
    ranks), every image readable."""
    shared.check_components(cfg, tuple(r.name for r in ROLES[1:]))
    family = model_folder_family(str(cfg.model.pretrained), str(cfg.model.tiny_family))
    if family and family not in CONTROLNET_PIPELINES:
        raise config_problem("model.pretrained", cfg.model.pretrained, f"is a {family} model; a ControlNet "
                             f"conditions a unet ({', '.join(CONTROLNET_PIPELINES)})", "give an SD 1.x/2.x or SDXL "
                             "folder")
    check_config_folder("roles.controlnet.model", str(cfg.roles.controlnet.model), "a ControlNetModel folder",
                        "give a folder saved with ControlNetModel.save_pretrained, or \"\"")
    if family:
        check_resolution(int(cfg.data.resolution), family, str(cfg.model.pretrained))
    shared.check_data(cfg, world_size, "controlnet", conditioning=True)


class ControlNetTraining(SDFinetune):
    """The SD fine-tune lifecycle with a trainable ``controlnet`` in front of a frozen ``unet``."""

    name = "controlnet"
    conditioning = True

    @property
    def trained(self) -> str:
        return "controlnet"

    @property
    def conditioning_column(self) -> str:
        return str(self.cfg.data.columns.conditioning_image or "conditioning_image")

    def check_family(self, where: str) -> None:
        if self.family not in CONTROLNET_PIPELINES:
            raise RecipeConfigError(f"model.pretrained={where!r} is a {self.family} model; the controlnet recipe "
                                    f"trains a ControlNet for a unet ({', '.join(CONTROLNET_PIPELINES)}).")

    def make_builtin_data(self, folder: str) -> None:
        cfg = self.cfg
        data_lib.make_shapes_controlnet_dataset(folder, cfg.data.builtin_size, cfg.data.resolution, seed=cfg.seed,
                                                kind=cfg.data.conditioning_kind)

    def add_roles(self) -> None:
        cfg, registry = self.cfg, self.registry
        frozen = {name: placement(cfg, ROLES, name) for name in ("unet", "vae", *self.text_encoders)}
        if cfg.mode == SEED_BASELINE:  # diffusers' train_controlnet.py: only the trained model goes through ZeRO
            frozen = {name: Placement(stage=0, dtype=p.dtype) for name, p in frozen.items()}
        variant = str(cfg.model.variant) or None
        c = cfg.roles.controlnet
        factory = controlnet_factory(self.model_path, seed=cfg.seed, variant=variant,
                                     controlnet_path=str(c.model) or None)
        registry.add(trainable_role("controlnet", factory, placement(cfg, ROLES, "controlnet"),
                                    optim_spec(cfg, "controlnet", cfg.max_steps, eps=float(cfg.diffusion.adam_epsilon)),
                                    micro_batch_size=c.micro_batch_size, grad_accum=c.grad_accum,
                                    gradient_checkpointing=c.gradient_checkpointing, seed=cfg.seed))
        for name, place in frozen.items():
            registry.add(frozen_role(name, lambda n=name: load_component(self.model_path, n, variant), place))

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
        cfg = self.cfg
        if not cfg.export.enabled:
            return {}
        # The frozen components are unchanged: copied from the source folder (cast to export.dtype), not gathered.
        return export_run(self.registry, self.path("export"), self.model_path, {"controlnet": "controlnet"},
                          dtype=cfg.export.dtype, prediction_type=self.prediction_type, first=["controlnet"],
                          roles=list(cfg.export.roles), class_name=CONTROLNET_PIPELINES[self.family], cast_copied=True)

    def summary_extra(self) -> dict[str, Any]:
        out = super().summary_extra()
        out.update({"conditioning_column": self.conditioning_column, "pipeline": CONTROLNET_PIPELINES[self.family]})
        if self.builtin_data:
            out["conditioning_kind"] = self.cfg.data.conditioning_kind
        return out


main = ControlNetTraining.main
plan = plans.controlnet  # what `multiengine plan` sees of this recipe

"""sd_finetune on a user's data: the validation prompts come from the user's held-out captions, and a short
real run (one process, torch backend) trains from a `datasets` save_to_disk folder on exactly its rows and
writes its validation grids to TensorBoard."""

from __future__ import annotations

import math
import os

import pytest
from datasets import Dataset
from multiengine.recipes import sd_finetune as recipe
from multiengine.recipes.language.config import checked_config, load_config


def _picker(tmp_path, *overrides):
    return recipe.SDFinetune(load_config("sd_finetune", "tiny", [f"output_dir={tmp_path}", *overrides]))


def test_validation_prompts_default_to_the_users_heldout_captions(tmp_path):
    heldout = Dataset.from_dict({"caption": ["a cat on a mat", "a cat on a mat", "a dog", "a red barn",
                                             "a blue lake"]})
    user = _picker(tmp_path, "data.source=/data/my_images", "validation.num_prompts=3")
    # distinct captions in row order, at most validation.num_prompts
    assert user.validation_prompts(heldout) == ["a cat on a mat", "a dog", "a red barn"]
    assert not set(user.validation_prompts(heldout)) & set(recipe.SHAPES_PROMPTS)
    assert _picker(tmp_path, "data.source=/data/my_images", "validation.num_prompts=9").validation_prompts(
        heldout) == ["a cat on a mat", "a dog", "a red barn", "a blue lake"]
    several = {"caption": [["a dog", "a hound"], ["a dog", "a puppy"], ["a cat"]]}  # several captions per image
    assert user.validation_prompts(several) == ["a dog", "a cat"]
    # the shapes prompts only for the built-in shapes data; explicit prompts always win
    assert _picker(tmp_path).validation_prompts(heldout) == list(recipe.SHAPES_PROMPTS)
    given = _picker(tmp_path, "data.source=/data/my_images", "validation.prompts=[a green frog]")
    assert given.validation_prompts(heldout) == ["a green frog"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """12 shapes images saved with `save_to_disk`, captions renamed to `prompt` and made unique per row."""
    from multiengine.pipelines.diffusion.data import load_image_caption_dataset, make_shapes_dataset

    root = tmp_path_factory.mktemp("sd_saved")
    folder = make_shapes_dataset(str(root / "shapes"), n=12, resolution=32, seed=0)
    ds = load_image_caption_dataset(folder, cache_dir=str(root / "cache")).rename_column("text", "prompt")
    ds = ds.map(lambda row, i: {"prompt": f"photo {i}: {row['prompt']}"}, with_indices=True)
    ds.save_to_disk(str(root / "saved"))
    return root, list(ds["prompt"])


def test_sd_finetune_trains_from_a_save_to_disk_folder(saved):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, captions = saved
    out = root / "out"
    cfg = checked_config("sd_finetune", "tiny", [
        f"output_dir={out}", f"data.source={root / 'saved'}", "data.columns.caption=prompt", "data.eval_split=4",
        "max_steps=2", "backend=torch", "model.tiny_vae_steps=0", "roles.unet.micro_batch_size=2", "ema.enabled=false",
        "eval.heldout_size=2", "eval.timesteps=2", "validation.num_inference_steps=1", "validation.num_prompts=2",
        "checkpoint.every=0", "export.enabled=false", "export.roles=[]", "plot=false"])
    job = recipe.SDFinetune(cfg)
    job.setup()
    try:
        seen: list[str] = []
        stream = job.batches

        def recorded():
            for batch in stream:
                seen.extend(batch["captions"])
                yield batch

        job.batches = recorded()
        job.train()
    finally:
        job.close()
    heldout = [c for batch in job.heldout_batches for c in batch["captions"]]
    assert str(root / "saved") in job.eval_origin and len(job.train_set) == 8  # 12 rows, 4 held out
    # it trained on the saved rows (2 steps x 2 images), never on the held-out ones
    assert len(seen) == 4 and set(seen) <= set(captions) and not set(seen) & set(heldout)
    # its validation prompts are the held-out captions of the user's rows, not the shapes prompts
    assert job.prompts == heldout and len(heldout) == 2 and set(heldout) <= set(captions)
    assert len(job.losses) == 2 and all(math.isfinite(x) and x > 0 for x in job.losses)
    assert math.isfinite(job.heldout["before/loss"]) and math.isfinite(job.heldout["after/loss"])
    # the grids (before, after) are PNGs and TensorBoard images at their steps
    assert [v["step"] for v in job.validations] == [0, 2] and all(os.path.isfile(v["file"]) for v in job.validations)
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    assert [e.step for e in events.Images("validation/grid")] == [0, 2]

"""Diffusion data: shapes dataset, loading with datasets, transforms, tokenization, collation, sampler."""

from __future__ import annotations

import collections
import functools
import itertools
import json
import os

import numpy as np
import pytest
import torch
from multiengine.pipelines.diffusion.data import (
    SHAPES_BACKGROUNDS,
    SHAPES_COLORS,
    SHAPES_KINDS,
    ImageCaptionDataset,
    ImageTransform,
    ShardedEpochSampler,
    collate,
    describe_shapes_image,
    load_image_caption_dataset,
    make_shapes_dataset,
    sample_generator,
    shapes_captions,
    tokenize_captions,
)
from PIL import Image


@pytest.fixture(scope="module")
def shapes_dir(tmp_path_factory) -> str:
    return make_shapes_dataset(str(tmp_path_factory.mktemp("data") / "shapes"), n=24, resolution=32, seed=0)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from multiengine.pipelines.diffusion.tiny import build_clip_tokenizer
    from transformers import CLIPTokenizer

    return CLIPTokenizer.from_pretrained(build_clip_tokenizer(str(tmp_path_factory.mktemp("tok"))))


def _rows(folder: str) -> list[dict]:
    with open(os.path.join(folder, "metadata.jsonl")) as f:
        return [json.loads(line) for line in f]


# --- shapes dataset --------------------------------------------------------------------------


def test_shapes_files_and_captions(shapes_dir):
    rows = _rows(shapes_dir)
    assert len(rows) == 24
    assert [r["file_name"] for r in rows] == [f"{i:05d}.png" for i in range(24)]
    for r in rows:
        assert r["text"] == f"a {r['color']} {r['shape']} on a {r['background']} background"
        with Image.open(os.path.join(shapes_dir, r["file_name"])) as im:
            assert im.size == (32, 32) and im.mode == "RGB"
    assert len(shapes_captions()) == len(SHAPES_COLORS) * len(SHAPES_KINDS) * len(SHAPES_BACKGROUNDS) == 54


def test_shapes_attributes_readable_from_pixels(tmp_path, shapes_dir):
    for folder in (shapes_dir, make_shapes_dataset(str(tmp_path / "s64"), n=24, resolution=64, seed=3)):
        for r in _rows(folder):
            got = describe_shapes_image(Image.open(os.path.join(folder, r["file_name"])))
            assert got == {k: r[k] for k in ("color", "shape", "background")}, r
    assert describe_shapes_image(Image.new("RGB", (32, 32), (0, 0, 0)))["color"] == "none"


def test_shapes_balanced_and_deterministic(tmp_path):
    a = make_shapes_dataset(str(tmp_path / "a"), n=54, seed=1)
    b = make_shapes_dataset(str(tmp_path / "b"), n=54, seed=1)
    c = make_shapes_dataset(str(tmp_path / "c"), n=54, seed=2)
    # one full cycle of 54 images covers every (colour, shape, background) exactly once
    assert sorted(r["text"] for r in _rows(a)) == sorted(shapes_captions())
    for name in ("metadata.jsonl", "00000.png", "00053.png"):
        with open(os.path.join(a, name), "rb") as fa, open(os.path.join(b, name), "rb") as fb:
            assert fa.read() == fb.read()
    assert _rows(a) != _rows(c)


def test_shapes_idempotent_and_rewrites_on_change(tmp_path):
    out = str(tmp_path / "s")
    make_shapes_dataset(out, n=5)
    png = os.path.join(out, "00000.png")
    before = os.stat(png).st_mtime_ns
    make_shapes_dataset(out, n=5)
    assert os.stat(png).st_mtime_ns == before
    make_shapes_dataset(out, n=5, resolution=16)  # different request -> regenerated
    with Image.open(png) as im:
        assert im.size == (16, 16)
    assert not [n for n in os.listdir(out) if ".tmp" in n]


# --- loading ---------------------------------------------------------------------------------


def test_load_imagefolder(shapes_dir, tmp_path):
    ds = load_image_caption_dataset(shapes_dir, cache_dir=str(tmp_path / "cache"))
    assert ds.num_rows == 24
    assert {"image", "text"} <= set(ds.column_names)
    by_text = collections.Counter(r["text"] for r in _rows(shapes_dir))
    assert collections.Counter(ds["text"]) == by_text
    row = ds[0]
    assert isinstance(row["image"], Image.Image) and row["image"].size == (32, 32)
    assert describe_shapes_image(row["image"])["color"] == row["color"]


def test_missing_column_message(shapes_dir, tmp_path):
    with pytest.raises(ValueError, match=r"caption_column='caption'.*available columns: \['image', 'text'"):
        load_image_caption_dataset(shapes_dir, caption_column="caption", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="image_column='pixels'"):
        load_image_caption_dataset(shapes_dir, image_column="pixels", cache_dir=str(tmp_path / "cache"))


def test_load_jsonl_with_relative_paths_and_parquet(shapes_dir, tmp_path):
    # jsonl next to the images, relative paths, custom column names
    rows = _rows(shapes_dir)[:5]
    jsonl = os.path.join(shapes_dir, "..", "captions.jsonl")
    with open(jsonl, "w") as f:
        f.writelines(
            json.dumps({"path": f"shapes/{r['file_name']}", "caption": r["text"]}) + "\n" for r in rows
        )
    ds = load_image_caption_dataset(
        jsonl, image_column="path", caption_column="caption", cache_dir=str(tmp_path / "c1")
    )
    assert ds.num_rows == 5 and ds["caption"] == [r["text"] for r in rows]
    img = ds[2]["path"]
    assert isinstance(img, Image.Image)
    assert describe_shapes_image(img)["shape"] == rows[2]["shape"]

    # parquet with embedded image bytes (what datasets writes for an Image column)
    parquet = str(tmp_path / "shapes.parquet")
    ds.to_parquet(parquet)
    back = load_image_caption_dataset(
        parquet, image_column="path", caption_column="caption", cache_dir=str(tmp_path / "c2")
    )
    assert np.array_equal(np.asarray(back[2]["path"]), np.asarray(img))

    with pytest.raises(ValueError, match="Unsupported data file"):
        txt = tmp_path / "x.txt"
        txt.write_text("hi")
        load_image_caption_dataset(str(txt))


# --- transforms ------------------------------------------------------------------------------


def _halves(w: int = 40, h: int = 20) -> Image.Image:
    """Left half red, right half blue."""
    arr = np.zeros((h, w, 3), dtype=np.uint8)
    arr[:, : w // 2] = (255, 0, 0)
    arr[:, w // 2 :] = (0, 0, 255)
    return Image.fromarray(arr)


def test_transform_resize_center_crop_and_range():
    t = ImageTransform(16, center_crop=True, random_flip=False)
    # 40x20 -> shorter side 16 -> 32x16 -> center crop columns 8..23: left 8 red, right 8 blue
    x, params = t.apply(_halves())
    assert x.shape == (3, 16, 16) and x.dtype == torch.float32
    assert params == {"original_size": (20, 40), "crop_top_left": (0, 8), "flipped": False}
    red, blue = torch.tensor([1.0, -1.0, -1.0]), torch.tensor([-1.0, -1.0, 1.0])
    for col in range(6):
        torch.testing.assert_close(x[:, 5, col], red)
    for col in range(10, 16):
        torch.testing.assert_close(x[:, 5, col], blue)
    assert float(x.min()) >= -1.0 and float(x.max()) <= 1.0
    white = t(Image.new("RGB", (16, 16), (255, 255, 255)))
    assert torch.equal(white, torch.ones(3, 16, 16))
    gray = t(Image.new("L", (30, 30), 0))  # non-RGB input is converted
    assert torch.equal(gray, -torch.ones(3, 16, 16))


def test_transform_random_flip_reproducible():
    img = _halves(32, 32)
    plain = ImageTransform(16, center_crop=True, random_flip=False)(img)
    t = ImageTransform(16, center_crop=True, random_flip=True)
    flips = 0
    for seed in range(20):
        x, p = t.apply(img, torch.Generator().manual_seed(seed))
        assert torch.equal(x, plain.flip(-1) if p["flipped"] else plain)
        y, _ = t.apply(img, torch.Generator().manual_seed(seed))
        assert torch.equal(x, y)
        flips += p["flipped"]
    assert 3 <= flips <= 17
    assert plain[0, 0, 0] == 1.0 and plain.flip(-1)[0, 0, 0] == -1.0


def test_transform_random_crop():
    arr = np.arange(48 * 64 * 3, dtype=np.uint32).reshape(48, 64, 3) % 251
    img = Image.fromarray(arr.astype(np.uint8))
    t = ImageTransform(48, center_crop=False, random_flip=False)
    offsets = set()
    for seed in range(10):
        x, p = t.apply(img, sample_generator(0, 0, seed))
        top, left = p["crop_top_left"]
        assert top == 0 and 0 <= left <= 16
        expected = torch.from_numpy(arr[:, left : left + 48].astype(np.float32)).permute(2, 0, 1) / 127.5 - 1
        torch.testing.assert_close(x, expected)  # no resize needed (shorter side already 48)
        offsets.add(left)
    assert len(offsets) >= 4


def test_sample_generator():
    def draw(*key):
        return torch.rand(4, generator=sample_generator(*key))

    assert torch.equal(draw(0, 1, 2), draw(0, 1, 2))
    assert not torch.equal(draw(0, 1, 2), draw(0, 2, 1))
    assert not torch.equal(draw(0, 1, 2), draw(1, 1, 2))


def test_image_caption_dataset(shapes_dir, tmp_path):
    ds = load_image_caption_dataset(shapes_dir, cache_dir=str(tmp_path / "cache"))
    wrapped = ImageCaptionDataset(ds, ImageTransform(16, center_crop=False, random_flip=True), seed=3)
    item = wrapped[4]
    assert item["caption"] == ds[4]["text"] and item["pixel_values"].shape == (3, 16, 16)
    assert torch.equal(wrapped[4]["pixel_values"], item["pixel_values"])
    epochs = []
    for e in range(6):
        wrapped.set_epoch(e)
        epochs.append(wrapped[4]["pixel_values"])
    assert any(not torch.equal(epochs[0], x) for x in epochs[1:])  # augmentation varies by epoch
    with pytest.raises(ValueError, match="available columns"):
        ImageCaptionDataset(ds, ImageTransform(16), caption_column="caption")


# --- tokenization / collation ----------------------------------------------------------------


def test_tokenize_captions(tokenizer):
    ids = tokenize_captions(tokenizer, ["a red square on a white background", "a blue circle"])
    assert ids.shape == (2, 77) and ids.dtype == torch.long
    assert ids[:, 0].tolist() == [tokenizer.bos_token_id] * 2
    assert ids[1, 4].item() == tokenizer.eos_token_id and ids[1, 5:].eq(tokenizer.pad_token_id).all()
    long = tokenize_captions(tokenizer, ["red " * 200])
    assert long.shape == (1, 77) and long[0, -1].item() == tokenizer.eos_token_id
    with pytest.raises(TypeError):
        tokenize_captions(tokenizer, "a single string")
    with pytest.raises(TypeError, match="caption 1"):
        tokenize_captions(tokenizer, ["ok", None])


def test_collate_and_dataloader(shapes_dir, tokenizer, tmp_path):
    ds = load_image_caption_dataset(shapes_dir, cache_dir=str(tmp_path / "cache"))
    wrapped = ImageCaptionDataset(ds, ImageTransform(32, center_crop=True, random_flip=True), seed=0)
    sampler = ShardedEpochSampler(len(wrapped), world_size=2, rank=1, seed=0)
    loader = torch.utils.data.DataLoader(
        wrapped, batch_size=4, sampler=sampler, collate_fn=functools.partial(collate, tokenizer=tokenizer)
    )
    batches = list(loader)
    assert len(batches) == 3  # 24 samples / 2 ranks / batch 4
    b = batches[0]
    assert b["pixel_values"].shape == (4, 3, 32, 32) and b["pixel_values"].dtype == torch.float32
    assert b["input_ids"].shape == (4, 77) and b["input_ids"].dtype == torch.long
    expected = [ds[i]["text"] for i in sampler.indices(0)[:4]]
    assert b["captions"] == expected
    torch.testing.assert_close(b["input_ids"], tokenize_captions(tokenizer, expected))

    pre = [{"pixel_values": torch.zeros(3, 8, 8), "caption": "x", "input_ids": torch.arange(5)}] * 2
    out = collate(pre)
    assert out["input_ids"].tolist() == [list(range(5))] * 2
    with pytest.raises(ValueError, match="tokenizer"):
        collate([{"pixel_values": torch.zeros(3, 8, 8), "caption": "x"}])


# --- sampler ---------------------------------------------------------------------------------


def test_sampler_sharding():
    plain = [list(ShardedEpochSampler(10, 3, r, shuffle=False)) for r in range(3)]
    assert plain == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]  # tail index 9 dropped
    shards = [ShardedEpochSampler(10, 3, r, seed=7) for r in range(3)]
    lists = [list(s) for s in shards]
    assert all(len(x) == 3 == len(s) for x, s in zip(lists, shards))
    flat = list(itertools.chain.from_iterable(lists))
    assert len(set(flat)) == 9
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(7)).tolist()
    assert lists[1] == perm[:9][1::3]
    with pytest.raises(ValueError):
        ShardedEpochSampler(2, 3, 0)
    with pytest.raises(ValueError):
        ShardedEpochSampler(10, 2, 2)


def test_sampler_epochs_and_auto_advance():
    s = ShardedEpochSampler(20, 2, 0, seed=1)
    s.set_epoch(0)
    e0 = list(s)
    e1 = list(s)  # no set_epoch: a fully consumed epoch advances by itself
    assert s.epoch == 1 and e1 == s.indices(1) and e0 != e1
    s.set_epoch(1)  # same epoch: nothing to replay, position kept
    assert s.position == 10
    s.set_epoch(5)
    assert s.position == 0 and list(s) == ShardedEpochSampler(20, 2, 0, seed=1).indices(5)


def test_sampler_resume():
    s = ShardedEpochSampler(17, 2, 1, seed=3)
    s.set_epoch(2)
    full = s.indices(2)
    it = iter(s)
    seen = [next(it) for _ in range(3)]
    state = s.state_dict()
    assert state["epoch"] == 2 and state["position"] == 3 and seen == full[:3]

    resumed = ShardedEpochSampler(17, 2, 1, seed=3)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON round trip
    resumed.set_epoch(2)  # what a training loop does at the top of the epoch: must not rewind
    assert list(resumed) == full[3:]
    assert list(resumed) == resumed.indices(3)  # then carries on into the next epoch

    # a checkpoint taken after the last sample resumes at the start of the next epoch
    done = ShardedEpochSampler(17, 2, 1, seed=3)
    done.load_state_dict({"epoch": 2, "position": 8})
    assert list(done) == done.indices(3)

    # prefetching loaders: the trainer reports what it actually consumed
    assert s.state_dict(consumed=1)["position"] == 1
    with pytest.raises(ValueError, match="world_size"):
        ShardedEpochSampler(17, 4, 1, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        ShardedEpochSampler(17, 2, 1, seed=4).load_state_dict(state)


def test_sampler_position_tracks_single_process_loader():
    s = ShardedEpochSampler(12, 1, 0, seed=0)
    loader = torch.utils.data.DataLoader(list(range(12)), batch_size=3, sampler=s)
    it = iter(loader)
    first = next(it)
    assert s.position == 3 and first.tolist() == s.indices(0)[:3]

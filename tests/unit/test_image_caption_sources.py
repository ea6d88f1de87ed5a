"""Image-caption data from every source kind (imagefolder, files, save_to_disk folders, hub names offline), column
mapping with the older keys as aliases, blends and held-out rows, and the up-front data check."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from multiengine.pipelines.diffusion.data import (
    check_image_caption_data,
    image_caption_columns,
    load_image_caption_data,
    load_image_caption_dataset,
    make_shapes_dataset,
)
from multiengine.pipelines.sources import DataSourceError


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    root = tmp_path_factory.mktemp("sd_sources")
    folder = make_shapes_dataset(str(root / "shapes"), n=12, resolution=16, seed=0)
    with open(os.path.join(folder, "metadata.jsonl")) as f:
        meta = [json.loads(line) for line in f]
    return {"root": root, "folder": folder, "meta": meta, "cache": str(root / "cache")}


def _pixels(ds, column="image"):
    return [np.asarray(im.convert("RGB")) for im in ds[column]]


def test_save_to_disk_folders_load(shapes, tmp_path):
    """The folder `Dataset.save_to_disk` writes (was: 'Instruction "train" corresponds to no data!')."""
    from datasets import DatasetDict

    ref = load_image_caption_dataset(shapes["folder"], cache_dir=shapes["cache"])
    ref.save_to_disk(str(tmp_path / "disk"))
    ds = load_image_caption_dataset(str(tmp_path / "disk"))
    assert ds["text"] == ref["text"] and all(np.array_equal(a, b) for a, b in zip(_pixels(ds), _pixels(ref)))
    DatasetDict({"train": ref.select(range(8)), "test": ref.select(range(8, 12))}).save_to_disk(str(tmp_path / "dd"))
    assert load_image_caption_dataset(str(tmp_path / "dd"), split="test")["text"] == ref["text"][8:]


def test_column_mapping_and_aliases(shapes):
    rows = [{"path": f"shapes/{r['file_name']}", "prompt": r["text"]} for r in shapes["meta"]]
    jsonl = os.path.join(shapes["root"], "pairs.jsonl")
    with open(jsonl, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    mapped = load_image_caption_dataset(jsonl, columns={"image": "path", "caption": "prompt"},
                                        cache_dir=shapes["cache"])
    alias = load_image_caption_dataset(jsonl, image_column="path", caption_column="prompt", cache_dir=shapes["cache"])
    assert mapped["prompt"] == alias["prompt"] == [r["text"] for r in shapes["meta"]]
    assert all(np.array_equal(a, b) for a, b in zip(_pixels(mapped, "path"), _pixels(alias, "path")))
    # data.columns wins over the older keys
    assert image_caption_columns({"caption": "prompt"}, "path", "text") == ("path", "prompt")
    with pytest.raises(DataSourceError, match=r"unknown field\(s\) \['text'\]"):
        image_caption_columns({"text": "prompt"})
    with pytest.raises(ValueError, match=r"caption_column='caption'.*data.columns.caption=<column>"):
        load_image_caption_dataset(jsonl, columns={"image": "path"}, caption_column="caption",
                                   cache_dir=shapes["cache"])


def test_blend_and_heldout_rows_have_the_canonical_columns(shapes):
    jsonl = os.path.join(shapes["root"], "pairs2.jsonl")
    with open(jsonl, "w") as f:
        f.writelines(json.dumps({"file": f"shapes/{r['file_name']}", "prompt": "x " + r["text"]}) + "\n"
                     for r in shapes["meta"])
    data = load_image_caption_data(
        [{"path": shapes["folder"], "weight": 1},
         {"path": jsonl, "weight": 1, "columns": {"image": "file", "caption": "prompt"}}],
        eval_split=2, seed=0, cache_dir=shapes["cache"])
    assert data.train.column_names == ["image", "caption"] and data.eval.column_names == ["image", "caption"]
    assert len(data.eval) == 4 and not set(data.eval["caption"]) & set(data.train["caption"])
    assert sum(c.startswith("x ") for c in data.train["caption"]) == 10  # equal weights, 20 rows
    one = load_image_caption_data(shapes["folder"], eval_split=0.25, seed=1, cache_dir=shapes["cache"])
    assert len(one.train) == 9 and len(one.eval) == 3
    with pytest.raises(DataSourceError, match="no 'test' split"):
        load_image_caption_data(jsonl, columns={"image": "file", "caption": "prompt"}, eval_split="test",
                                cache_dir=shapes["cache"])


def test_check_image_caption_data(shapes, tmp_path):
    report = check_image_caption_data(shapes["folder"], cache_dir=shapes["cache"])
    assert report["rows"] == 12 and report["sources"][0]["caption_column"] == "text"
    with pytest.raises(DataSourceError, match=r"no such file or folder: .*nothing_here \(data.source\)"):
        check_image_caption_data(str(tmp_path / "nothing_here"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"image": os.path.join(shapes["folder"], r["file_name"]), "label": i}) + "\n"
                           for i, r in enumerate(shapes["meta"])))
    with pytest.raises(DataSourceError, match=r"column 'label' holds int, not text"):
        check_image_caption_data(str(bad), columns={"caption": "label"}, cache_dir=shapes["cache"])


def test_hub_name_offline_from_the_cache(shapes, tmp_path):
    from datasets.packaged_modules.json.json import Json

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"img": os.path.join(shapes["folder"], r["file_name"]), "caption": r["text"]})
                            + "\n" for r in shapes["meta"]))
    Json(cache_dir=str(tmp_path / "build"), dataset_name="tiny-shapes", data_files={"train": str(rows)},
         hash="0123abcd").download_and_prepare()
    cache = tmp_path / "hub_cache" / "someone___tiny-shapes"
    cache.mkdir(parents=True)
    shutil.move(glob.glob(str(tmp_path / "build" / "tiny-shapes" / "default-*"))[0], str(cache / "default"))
    code = (
        "import json\n"
        "from multiengine.pipelines.diffusion.data import load_image_caption_dataset\n"
        f"ds = load_image_caption_dataset('someone/tiny-shapes', columns={{'image': 'img', 'caption': 'caption'}}, "
        f"cache_dir={str(tmp_path / 'hub_cache')!r})\n"
        "print(json.dumps({'captions': list(ds['caption']), 'size': list(ds[0]['img'].size)}))\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"captions": [r["text"] for r in shapes["meta"]], "size": [16, 16]}

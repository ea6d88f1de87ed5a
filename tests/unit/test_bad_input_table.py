"""Bad inputs that used to run or fail late, each refused up front with the key, the value and the fix."""

from __future__ import annotations

import pytest
from multiengine.recipes.config import DuplicateKeyError, RecipeConfigError, _yaml_load, load_config


# --- a YAML key set twice ---------------------------------------------------------------------------------
def test_a_yaml_key_set_twice_names_the_key_and_both_lines(tmp_path):
    path = tmp_path / "my.yaml"
    path.write_text("# my run\nmax_steps: 3\ntrain:\n  lr: 1.0e-3\n  micro_batch_size: 2\n  lr: 2.0e-3\n")
    with pytest.raises(RecipeConfigError) as err:
        load_config("rlhf_sft", str(path))
    assert str(err.value) == (f"config file {path}: key 'train.lr' is set twice, on line 4 and on line 6; YAML would "
                              "keep only the second value; fix: delete one of the two lines")


def test_duplicate_keys_are_found_in_lists_and_overrides_but_merge_keys_pass():
    with pytest.raises(DuplicateKeyError) as err:
        _yaml_load("a:\n  - {x: 1}\n  - {x: 1,\n     x: 3}\n")
    assert (err.value.key, err.value.first_line, err.value.second_line) == ("a[1].x", 3, 4)
    # the same name in two sections, and a merge key overridden beside it, are not duplicates
    assert _yaml_load("a: {x: 1}\nb: {x: 2}\n") == {"a": {"x": 1}, "b": {"x": 2}}
    assert _yaml_load("base: &b {x: 1}\nother:\n  <<: *b\n  x: 2\n")["other"] == {"x": 2}
    with pytest.raises(RecipeConfigError, match=r"malformed override 'validation=\{a: 1, a: 2\}': key 'a' is set "
                                                r"twice"):
        load_config("rlhf_sft", "tiny", ["validation={a: 1, a: 2}"])

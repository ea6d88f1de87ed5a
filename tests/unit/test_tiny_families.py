"""Tiny configs of the model families the tests and users' docs build."""

import pytest
from multiengine.pipelines.rlhf import tiny


def test_unknown_family_names_the_known_ones():
    with pytest.raises(ValueError, match="llama"):
        tiny.tiny_lm_config("lama", 64)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "phi3", "gpt2"])
def test_tiny_config_sizes_and_no_dropout(family):
    config = tiny.tiny_lm_config(family, 100, hidden=64, layers=2)
    assert config.model_type == family and config.vocab_size == 100
    assert config.num_hidden_layers == 2 and config.hidden_size == 64
    for key in ("attention_dropout", "resid_pdrop", "embd_pdrop", "dropout", "hidden_dropout"):
        assert getattr(config, key, 0.0) == 0.0, key

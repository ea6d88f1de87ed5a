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


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_a_trained_tokenizer_in_a_family_folder_encodes_as_saved(tmp_path, family, caplog):
    """transformers builds Qwen2's own tokenizer class for a qwen2 folder even when tokenizer_config.json
    declares the generic one: a word-level tokenizer then encodes "list 3 fruits : apple" as 3 ids, not 6."""
    from multiengine.pipelines.checks import load_tokenizer
    from tokenizers import Tokenizer

    tiny.train_tokenizer(tiny.task_vocabulary(), tmp_path / "tok", chat_template=True)
    folder = tiny.build_tiny_causal_lm(tmp_path / family, tmp_path / "tok", hidden=16, layers=1, family=family)
    text = "list 3 fruits : apple pear"
    raw = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids
    with caplog.at_level("WARNING"):
        tok = load_tokenizer(str(folder))
    assert tok(text)["input_ids"] == raw and len(raw) == 7
    assert tok.apply_chat_template([{"role": "user", "content": "list 3 fruits :"}], tokenize=False,
                                   add_generation_prompt=True) == "<s><|user|> list 3 fruits : <|assistant|> "
    assert ("encodes text differently" in caplog.text) == (family == "qwen2")


@pytest.mark.parametrize("family", tiny.MOE_FAMILIES)
def test_tiny_moe_configs_route_4_experts_top_2_at_the_family_coefficient(family):
    from multiengine.engines.moe import MoeShape, moe_shape
    from transformers import AutoConfig

    config = tiny.tiny_lm_config(family, 100, hidden=32, layers=2)
    assert family in tiny.TINY_FAMILIES and config.model_type == family
    default = AutoConfig.for_model(family).router_aux_loss_coef
    assert default > 0 and moe_shape(config) == MoeShape(experts=4, top_k=2, aux_coef=default)
    assert getattr(config, "router_jitter_noise", 0.0) == 0.0 and not config.output_router_logits
    assert getattr(config, "moe_intermediate_size", None) in (None, 32) and config.intermediate_size <= 64

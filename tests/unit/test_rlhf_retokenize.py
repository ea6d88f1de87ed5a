"""Tokenizers per role: vocabulary comparison, and re-encoding actor sequences for a reward model with another
tokenizer (a word-level actor tokenizer, a sub-word BPE reward tokenizer with other special ids): the re-encoded
rows are exactly the texts encoded directly, and a tiny reward model gives them the same scores."""

from __future__ import annotations

import pytest
import torch
from multiengine.pipelines.rlhf import tiny
from multiengine.pipelines.rlhf.data import PairCollator, PromptCollator, _Encoder
from multiengine.pipelines.rlhf.models import ScalarHeadModel
from multiengine.pipelines.rlhf.retokenize import Retokenizer, needs_reencoding, vocabularies_match

PROMPTS = ["list 3 fruits :", "name 2 animals :", "say 4 colors :"]
ANSWERS = ["apple pear plum", "cat dog", "red blue green yellow"]
ENDED = [True, True, False]  # the last answer ran to max_new_tokens without an EOS (so it has no padding)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("retok")
    corpus = tiny.build_corpus(0, n_sft=400, n_reward=10, n_ppo=10, n_eval=10)
    actor = tiny.train_tokenizer(tiny.task_vocabulary(), root / "actor_tok")
    reward = tiny.train_bpe_tokenizer([f"{r['prompt']} {r['response']}" for r in corpus["sft"]], root / "reward_tok")
    folder = tiny.build_tiny_causal_lm(root / "reward_lm", root / "reward_tok", hidden=32, layers=1, seed=0)
    rm = ScalarHeadModel.from_pretrained(folder, head_seed=0)
    rm.init_head(std=1.0, seed=0)
    return {"root": root, "actor": actor, "reward": reward, "rm": rm.eval()}


def _actor_batch(tok, width=4):
    prompts = PromptCollator(tok, 16)(PROMPTS)
    rows = []
    for answer, ended in zip(ANSWERS, ENDED, strict=True):
        ids = tok(answer, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if ended else [])
        rows.append(ids + [tok.pad_token_id] * (width - len(ids)))
    return prompts, torch.tensor(rows)


def test_vocabularies_are_compared_not_names(assets, tmp_path):
    from transformers import AutoTokenizer

    actor, reward = assets["actor"], assets["reward"]
    copy = AutoTokenizer.from_pretrained(str(assets["root"] / "actor_tok"))
    copy.save_pretrained(str(tmp_path / "renamed"))
    renamed = AutoTokenizer.from_pretrained(str(tmp_path / "renamed"))
    assert vocabularies_match(actor, renamed) and not needs_reencoding(actor, renamed)
    assert not vocabularies_match(actor, reward)
    # same words, appended role tokens: a different vocabulary
    chat = tiny.train_tokenizer(tiny.task_vocabulary(), tmp_path / "chat", chat_template=True)
    assert not vocabularies_match(actor, chat)
    # equal vocabularies, different chat templates: only conversational data needs re-encoding
    chat2 = AutoTokenizer.from_pretrained(str(tmp_path / "chat"))
    chat2.chat_template = tiny.CHAT_TEMPLATE.replace("<|assistant|> {% endif %}", "<|assistant|>{% endif %}")
    assert vocabularies_match(chat, chat2)
    assert needs_reencoding(chat, chat2, conversational=True) and not needs_reencoding(chat, chat2)


def test_reencoded_rows_equal_direct_encoding_and_scores(assets):
    actor, reward, rm = assets["actor"], assets["reward"], assets["rm"]
    prompts, responses = _actor_batch(actor)
    retok = Retokenizer(actor, reward, max_prompt_len=32, max_response_len=32)
    assert retok.needed
    out = retok(prompts["input_ids"], prompts["attention_mask"], responses)  # prompts decoded from the ids
    assert out["reencoded"] and out["responses"] == ANSWERS
    # direct: the texts encoded with the reward tokenizer by hand (BOS + prompt pieces, answer pieces, EOS if any)
    direct = [reward(p)["input_ids"] + reward(a, add_special_tokens=False)["input_ids"]
              + ([reward.eos_token_id] if e else []) for p, a, e in zip(PROMPTS, ANSWERS, ENDED, strict=True)]
    assert actor.eos_token_id != reward.eos_token_id or actor.pad_token_id != reward.pad_token_id
    for row, mask, expected in zip(out["input_ids"], out["attention_mask"], direct, strict=True):
        n = int(mask.sum())
        assert row[:n].tolist() == expected and (row[n:] == reward.pad_token_id).all()
    with torch.no_grad():
        scores = rm.score(out["input_ids"], out["attention_mask"])
        one_by_one = torch.stack([rm.score(torch.tensor([d]), torch.ones(1, len(d), dtype=torch.long))[0]
                                  for d in direct])
        # what the reward model was trained on in step 2 (its own pair collator) gives the same scores
        rows = [{"prompt": p, "chosen": a, "rejected": a} for p, a in zip(PROMPTS, ANSWERS)]
        pair = PairCollator(reward, 32, 32)(rows)
        trained_layout = rm.score(pair["input_ids"], pair["attention_mask"])[: len(PROMPTS)]
    assert torch.allclose(scores, one_by_one, atol=1e-5)
    assert torch.allclose(scores[:2], trained_layout[:2], atol=1e-5)
    # the actor's own ids read as reward-model ids would have been scored differently
    with torch.no_grad():
        wrong = rm.score(torch.cat([prompts["input_ids"], responses], 1),
                         torch.cat([prompts["attention_mask"], retok.response_mask(responses)], 1))
    assert not torch.allclose(wrong, scores, atol=1e-3)


def test_original_prompts_survive_actor_truncation(assets):
    actor, reward = assets["actor"], assets["reward"]
    long_prompt = "please list 3 fruits : " * 1 + "list 3 fruits :"
    prompts = PromptCollator(actor, 4)([long_prompt])  # the actor saw only BOS + the last 3 tokens
    responses = torch.tensor([actor("apple pear plum", add_special_tokens=False)["input_ids"] + [actor.eos_token_id]])
    retok = Retokenizer(actor, reward, 64, 16)
    given = retok(prompts["input_ids"], prompts["attention_mask"], responses, prompts=[long_prompt])
    decoded = retok(prompts["input_ids"], prompts["attention_mask"], responses)
    expected = _Encoder(reward, 64, 16).pair_ids(long_prompt, "apple pear plum")
    assert given["input_ids"][0].tolist() == expected
    assert decoded["input_ids"].shape[1] < len(expected)


def test_same_vocabulary_is_not_reencoded(assets):
    from transformers import AutoTokenizer

    actor = assets["actor"]
    twin = AutoTokenizer.from_pretrained(str(assets["root"] / "actor_tok"))
    prompts, responses = _actor_batch(actor)
    out = Retokenizer(actor, twin, 16, 16)(prompts["input_ids"], prompts["attention_mask"], responses, align=True)
    assert not out["reencoded"]
    c = prompts["input_ids"].shape[1]
    assert torch.equal(out["input_ids"][:, :c], prompts["input_ids"])
    mask = out["attention_mask"][:, c:]
    assert mask.sum(1).tolist() == [4, 3, 4]  # up to and including the first EOS
    assert torch.equal(out["input_ids"][:, c:][mask.bool()], responses[mask.bool()])
    assert out["value_index"][0].tolist() == list(range(c, c + responses.shape[1]))


def test_value_index_maps_actor_tokens_to_the_reward_tokens_ending_them(assets):
    actor, reward = assets["actor"], assets["reward"]
    prompts, responses = _actor_batch(actor)
    out = Retokenizer(actor, reward, 32, 32)(prompts["input_ids"], prompts["attention_mask"], responses, align=True)
    index = out["value_index"]
    assert index.shape == responses.shape
    for b, answer in enumerate(ANSWERS):
        n = int(out["attention_mask"][b].sum())
        start = len(reward(PROMPTS[b])["input_ids"])
        words = answer.split()
        for t in range(len(words)):
            j = int(index[b, t])
            ids = out["input_ids"][b].tolist()
            covered = "".join(reward.decode(ids[start:j + 1], skip_special_tokens=True).split())
            before = "".join(reward.decode(ids[start:j], skip_special_tokens=True).split())
            assert covered.startswith("".join(words[: t + 1])) and len(before) < len("".join(words[: t + 1]))
        if ENDED[b]:
            assert int(index[b, len(words)]) == n - 1  # actor EOS -> reward EOS
        assert int(index[b, -1]) == n - 1


def test_conversational_prompts_are_rendered_with_the_reward_template(assets, tmp_path):
    actor = tiny.train_tokenizer(tiny.task_vocabulary(), tmp_path / "a", chat_template=True)
    reward = tiny.train_bpe_tokenizer(tiny.task_vocabulary() * 3, tmp_path / "b", vocab_size=150)
    reward.add_special_tokens({"additional_special_tokens": list(tiny.CHAT_ROLE_TOKENS)})
    reward.chat_template = tiny.CHAT_TEMPLATE
    messages = [[{"role": "user", "content": p}] for p in PROMPTS]
    prompts = PromptCollator(actor, 16)([{"prompt": m} for m in messages])
    _, responses = _actor_batch(actor)
    retok = Retokenizer(actor, reward, 32, 32, conversational=True)
    with pytest.raises(ValueError, match="pass prompt_messages"):
        retok(prompts["input_ids"], prompts["attention_mask"], responses)
    out = retok(prompts["input_ids"], prompts["attention_mask"], responses, prompt_messages=prompts["prompt_messages"])
    enc = _Encoder(reward, 32, 32)
    for b in range(3):
        p, r = enc.conversation_ids(messages[b], ANSWERS[b], eos=ENDED[b])
        n = int(out["attention_mask"][b].sum())
        assert out["input_ids"][b, :n].tolist() == p + r
        assert "<|assistant|>" in reward.convert_ids_to_tokens(p)[-2:]  # (+ the template's trailing space)
        assert (r[-1] == reward.eos_token_id) == ENDED[b]

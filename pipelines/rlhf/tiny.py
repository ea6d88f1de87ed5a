"""The embedded default for RLHF: a tiny word-listing task, its judge, tokenizer and model.

A prompt asks for ``n`` words of a topic (``"list 3 fruits :"``); the answer is a space-separated list of words.
:func:`judge` scores it in ``[0, 1]``::

    hits   = min(#on-topic words that differ from the word before them, n)
    extras = #words - hits          (off-topic words, stutters, or more than n words)
    score  = clip((hits - 0.5 * extras) / n, 0, 1)

so only exactly ``n`` on-topic words without a stutter score 1. Repeats are judged between neighbours only: a
stutter is a local pattern a 2-layer reward model learns reliably, whereas "any duplicate anywhere" was learned so
poorly that PPO against it drifted to answers like "tram tram tram truck". The SFT demonstrations mix perfect and
mediocre answers, so imitating them scores clearly below 1; preference pairs are ranked by the judge. Everything is
word level (5-token prompts, answers of at most ``n + 3`` tokens): a 2-layer, 64-wide model learns it on CPU in
minutes.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import re
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from multiengine.engines.settings import Range, Settings, setting

if TYPE_CHECKING:
    from multiengine.engines.planner import ModelInfo
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

__all__ = ["BOS_TOKEN", "CHAT_ROLE_TOKENS", "CHAT_TEMPLATE", "COUNTS", "EOS_TOKEN", "MOE_FAMILIES", "PAD_TOKEN",
           "TINY_FAMILIES", "TOPICS", "UNK_TOKEN", "TinySettings", "build_corpus", "build_tiny_causal_lm", "judge",
           "make_prompt", "parse_prompt", "prepare_builtin", "task_vocabulary", "tiny_lm_config", "tiny_model_info",
           "train_bpe_tokenizer", "train_tokenizer", "write_builtin_dataset"]

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"

TOPICS: dict[str, tuple[str, ...]] = {
    "fruits": ("apple", "pear", "plum", "mango", "grape", "lemon", "peach", "cherry", "melon", "kiwi"),
    "animals": ("cat", "dog", "horse", "tiger", "lion", "mouse", "zebra", "camel", "wolf", "bear"),
    "colors": ("red", "blue", "green", "yellow", "purple", "orange", "black", "white", "pink", "brown"),
    "tools": ("hammer", "saw", "drill", "wrench", "chisel", "pliers", "file", "axe", "spade", "rake"),
    "vehicles": ("car", "bus", "train", "truck", "bike", "boat", "plane", "tram", "van", "ship"),
    "instruments": ("piano", "violin", "drum", "flute", "guitar", "harp", "cello", "trumpet", "oboe", "banjo"),
    "sports": ("tennis", "golf", "rugby", "hockey", "boxing", "rowing", "soccer", "cricket", "judo", "polo"),
    "countries": ("france", "spain", "italy", "japan", "chile", "peru", "kenya", "egypt", "norway", "india"),
}
COUNTS: tuple[int, ...] = (2, 3, 4)
_VERBS: tuple[str, ...] = ("list", "name", "give", "write", "say", "tell")
_PROMPT_RE = re.compile(r"^\s*(\w+)\s+(\d+)\s+(\w+)\s*:\s*$")


def make_prompt(verb: str, n: int, topic: str) -> str:
    """``"list 3 fruits :"``."""
    return f"{verb} {n} {topic} :"


def parse_prompt(prompt: str) -> tuple[int, str] | None:
    """``(n, topic)`` of a task prompt, or ``None`` if it is not one."""
    match = _PROMPT_RE.match(prompt)
    if match is None or match.group(3) not in TOPICS:
        return None
    return int(match.group(2)), match.group(3)


def judge(prompt: str, answer: str) -> float:
    """Programmatic reward in ``[0, 1]`` (module docstring); 0 for unknown prompts. The answer is read up to its
    first ``</s>``, ignoring special tokens left in it."""
    parsed = parse_prompt(prompt)
    if parsed is None:
        return 0.0
    n, topic = parsed
    answer = answer.split(EOS_TOKEN, 1)[0]
    words = [w for w in answer.split() if w not in (PAD_TOKEN, BOS_TOKEN, UNK_TOKEN)]
    on_topic = set(TOPICS[topic])
    hits = min(sum(w in on_topic and (i == 0 or w != words[i - 1]) for i, w in enumerate(words)), n)
    extras = len(words) - hits
    return float(min(max((hits - 0.5 * extras) / n, 0.0), 1.0))


def task_vocabulary() -> list[str]:
    """Every word the task can use (prompts and answers), so a tokenizer never needs ``<unk>``."""
    words = {w for ws in TOPICS.values() for w in ws}
    words |= set(TOPICS) | set(_VERBS) | {str(n) for n in range(1, 10)} | {":"}
    return sorted(words)


# --------------------------------------------------------------------------------------------------
# corpus
# --------------------------------------------------------------------------------------------------


def _sample_prompt(rng: random.Random) -> tuple[str, int, str]:
    topic = rng.choice(sorted(TOPICS))
    n = rng.choice(COUNTS)
    return make_prompt(rng.choice(_VERBS), n, topic), n, topic


def _good_answer(rng: random.Random, n: int, topic: str) -> list[str]:
    return rng.sample(TOPICS[topic], n)


def _mediocre_answer(rng: random.Random, n: int, topic: str) -> list[str]:
    """A plausible but flawed answer (score roughly 0.25-0.8): one of four typical mistakes."""
    words = _good_answer(rng, n, topic)
    other = rng.choice([t for t in sorted(TOPICS) if t != topic])
    kind = rng.randrange(4)
    if kind == 0:  # one word from another topic
        words[rng.randrange(n)] = rng.choice(TOPICS[other])
    elif kind == 1:  # a stutter: the last word repeats the one before it
        words[-1] = words[-2]
    elif kind == 2:  # one word too many (may be off topic)
        words.append(rng.choice(TOPICS[rng.choice((topic, other))]))
    else:  # one word too few
        words = words[:-1]
    return words


def _bad_answer(rng: random.Random, n: int, topic: str) -> list[str]:
    """Mostly off-topic or wrong-length answers (score roughly 0-0.25)."""
    other = rng.choice([t for t in sorted(TOPICS) if t != topic])
    k = rng.choice((1, n, n + 2))
    words = [rng.choice(TOPICS[other]) for _ in range(k)]
    if rng.random() < 0.5:
        words[0] = rng.choice(TOPICS[topic])
    return words


def _degenerate_answer(rng: random.Random, n: int, topic: str) -> list[str]:
    """What a policy drifts to under an imperfect reward model: stutters and over-long lists.

    Reward pairs must contain these, or the reward model never learns to penalise them and PPO
    exploits it (observed: "trumpet trumpet trumpet trumpet" for "list 4 instruments :").
    """
    kind = rng.randrange(3)
    if kind == 0:  # one on-topic word over and over
        return [rng.choice(TOPICS[topic])] * rng.randint(2, n + 3)
    if kind == 1:  # a good answer followed by stutters of its last word
        words = _good_answer(rng, n, topic)
        return words + [words[-1]] * rng.randint(1, 3)
    return rng.sample(TOPICS[topic], min(len(TOPICS[topic]), n + rng.randint(2, 4)))  # far too long


def _noisy_answer(rng: random.Random, n: int, topic: str) -> list[str]:
    """Several mistakes at once, like samples of a half-trained policy (e.g. "tram bus black car chisel"):
    a length near ``n``, each word on topic with probability 0.7 (drawn with replacement, so repeats
    happen) or from another topic."""
    others = [w for t in sorted(TOPICS) if t != topic for w in TOPICS[t]]
    length = max(1, n + rng.choice((-1, 0, 0, 1, 2)))
    return [rng.choice(TOPICS[topic]) if rng.random() < 0.7 else rng.choice(others) for _ in range(length)]


def _corrupt(rng: random.Random, words: list[str], n: int, topic: str) -> list[str]:
    """A minimal edit of a good answer that lowers its score: one stutter, off-topic word, extra or
    missing word, or all words the same. Minimal pairs teach the reward model each rule separately."""
    words = list(words)
    other = rng.choice([t for t in sorted(TOPICS) if t != topic])
    kind = rng.randrange(5)
    if kind == 0:
        i = rng.randrange(1, n)
        words[i] = words[i - 1]
    elif kind == 1:
        words[rng.randrange(n)] = rng.choice(TOPICS[other])
    elif kind == 2:
        words.insert(rng.randrange(n + 1), rng.choice(words + [rng.choice(TOPICS[other])]))
    elif kind == 3:
        del words[rng.randrange(n)]
    else:
        words = [words[0]] * n
    return words


_PAIR_MAKERS = (_good_answer, _good_answer, _mediocre_answer, _noisy_answer, _noisy_answer, _bad_answer,
                _degenerate_answer)


def _pair(rng: random.Random, prompt: str, n: int, topic: str) -> tuple[str, str] | None:
    """``(chosen, rejected)`` for ``prompt``, ordered by :func:`judge`; ``None`` for a tie or a short answer
    (draw again). Half are minimal pairs (an answer and a slightly worse edit of it)."""
    if rng.random() < 0.5:
        words = rng.choice(_PAIR_MAKERS)(rng, n, topic)
        if len(words) < n:
            return None
        a, b = " ".join(words), " ".join(_corrupt(rng, words[:n], n, topic) + words[n:])
    else:
        a = " ".join(rng.choice(_PAIR_MAKERS)(rng, n, topic))
        b = " ".join(rng.choice(_PAIR_MAKERS)(rng, n, topic))
    sa, sb = judge(prompt, a), judge(prompt, b)
    if sa == sb:
        return None  # a tie carries no preference
    return (a, b) if sa > sb else (b, a)


def _demonstration(rng: random.Random, n: int, topic: str, good_fraction: float) -> str:
    make = _good_answer if rng.random() < good_fraction else _mediocre_answer
    return " ".join(make(rng, n, topic))


def build_corpus(seed: int = 0, n_sft: int = 2000, n_reward: int = 6000, n_ppo: int = 1000, n_eval: int = 128,
                 sft_good_fraction: float = 0.4) -> dict[str, list[dict[str, str]]]:
    """Deterministic splits of the built-in task: ``sft`` (prompt, response: good with probability
    ``sft_good_fraction``, else mediocre), ``reward`` (prompt, chosen, rejected: half minimal pairs, an answer and a
    one-edit corruption, half two candidates of good, mediocre, noisy, bad and degenerate answers; ordered by
    :func:`judge`, ties redrawn), ``ppo`` (prompt) and ``eval``: rows held out for every stage at once (a prompt, a
    demonstration and a pair), so no step trains on the rows it is evaluated on."""
    rng = random.Random(seed)
    sft = []
    for _ in range(n_sft):
        prompt, n, topic = _sample_prompt(rng)
        sft.append({"prompt": prompt, "response": _demonstration(rng, n, topic, sft_good_fraction)})

    reward = []
    while len(reward) < n_reward:
        prompt, n, topic = _sample_prompt(rng)
        pair = _pair(rng, prompt, n, topic)
        if pair is not None:
            reward.append({"prompt": prompt, "chosen": pair[0], "rejected": pair[1]})

    ppo = [{"prompt": _sample_prompt(rng)[0]} for _ in range(n_ppo)]
    prompts = [_sample_prompt(rng) for _ in range(n_eval)]
    # the answers of the evaluation rows come from their own stream: the prompts stay those of every version
    answers = random.Random(seed * 1_000_003 + 17)
    evaluation = []
    for prompt, n, topic in prompts:
        response = _demonstration(answers, n, topic, sft_good_fraction)
        pair = None
        while pair is None:
            pair = _pair(answers, prompt, n, topic)
        evaluation.append({"prompt": prompt, "response": response, "chosen": pair[0], "rejected": pair[1]})
    return {"sft": sft, "reward": reward, "ppo": ppo, "eval": evaluation}


def write_builtin_dataset(out_dir: str | Path, seed: int = 0, **sizes: int) -> dict[str, Path]:
    """:func:`build_corpus`'s splits as ``{split}.jsonl`` (DeepSpeed-Chat's column names); the path of each."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in build_corpus(seed, **sizes).items():
        path = out / f"{split}.jsonl"
        with path.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        paths[split] = path
    logger.info("wrote built-in RLHF dataset (seed %d) to %s", seed, out)
    return paths


# --- tokenizer and model -------------------------------------------------------------------------------------------
# A minimal chat template for the word-level tokenizer: one role token per turn, each assistant turn closed by
# EOS (what generation stops on), and the generation prompt "<|assistant|>".
CHAT_ROLE_TOKENS: tuple[str, ...] = ("<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
    "{% if m['role'] == 'assistant' %}{{ eos_token }} {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def train_tokenizer(texts: Iterable[str], out_dir: str | Path, vocab_size: int = 512,
                    chat_template: bool = False) -> PreTrainedTokenizerFast:
    """A word-level ``PreTrainedTokenizerFast`` trained on ``texts`` and saved to ``out_dir``: one token per word,
    ``<pad>`` 0, ``<s>`` 1 (starts every text), ``</s>`` 2, ``<unk>`` 3, left padding (generation continues right
    after the prompt); with ``chat_template`` the role tokens :data:`CHAT_ROLE_TOKENS` are appended (word ids do not
    move) and :data:`CHAT_TEMPLATE` is set."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN]
    tok = Tokenizer(models.WordLevel(unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins word tokens with spaces
    trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, min_frequency=1, special_tokens=specials)
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
                                   unk_token=UNK_TOKEN, padding_side="left", model_max_length=128)
    if chat_template:
        fast.add_special_tokens({"additional_special_tokens": list(CHAT_ROLE_TOKENS)})
        fast.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    logger.info("trained word-level tokenizer (%d tokens) in %s", len(fast), out)
    return fast


def train_bpe_tokenizer(texts: Iterable[str], out_dir: str | Path, vocab_size: int = 120) -> PreTrainedTokenizerFast:
    """A second, different tokenizer for the same task: sub-word BPE (words split into pieces), other special
    token ids (``<unk>`` = 0, ``<s>`` = 1, ``</s>`` = 2, ``<pad>`` = 3), right padding. For tests of roles with
    different tokenizers; saved to ``out_dir`` like :func:`train_tokenizer`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN]
    tok = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, special_tokens=specials)
    tok.train_from_iterator(list(texts), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, tok.token_to_id(BOS_TOKEN))]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN,
                                   pad_token=PAD_TOKEN, unk_token=UNK_TOKEN, padding_side="right", model_max_length=128)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    logger.info("trained BPE tokenizer (%d tokens) in %s", len(fast), out)
    return fast


@dataclass(frozen=True)
class TinySettings(Settings):
    """The random tiny OPT built under output_dir/tiny for roles whose model is "" (mechanics only)."""

    hidden: int = setting(64, "width of the random tiny model (roles whose model is \"\")", Range(8))
    layers: int = setting(2, "layers of the random tiny model", Range(1))
    heads: int = setting(0, "attention heads (0 = hidden / 16: head size 16; vLLM on CPU needs head size >= 32)",
                         Range(0))


# The mixtures of experts among the families below: 4 experts, top 2, each expert half the dense MLP's width.
MOE_FAMILIES: tuple[str, ...] = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
# The decoder families users bring, as tiny configs: each entry maps the sizes below to that family's own
# config keys, with dropout off (actor and ref must agree token for token).
TINY_FAMILIES: tuple[str, ...] = ("opt", "gpt2", "gpt_neox", "llama", "mistral", "qwen2", "qwen3", "gemma",
                                  "gemma2", "gemma3_text", "phi3", *MOE_FAMILIES)


def tiny_lm_config(family: str, vocab_size: int, hidden: int = 64, layers: int = 2, *, pad_token_id: int = 0,
                   bos_token_id: int = 1, eos_token_id: int = 2, max_positions: int = 128, heads: int = 0) -> Any:
    """A transformers config of a tiny decoder of ``family`` (a :data:`TINY_FAMILIES` ``model_type``): ``hidden``
    wide, ``layers`` deep, ``heads`` heads (0 = ``hidden // 16``; half as many key/value heads where the family has
    grouped-query attention), no dropout; ValueError naming the known families for another one."""
    from transformers import AutoConfig

    heads = heads or max(1, hidden // 16)
    ids = {"vocab_size": vocab_size, "pad_token_id": pad_token_id, "bos_token_id": bos_token_id,
           "eos_token_id": eos_token_id}
    rope = {"hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2),
            "max_position_embeddings": max_positions, "attention_dropout": 0.0}
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": hidden}
    keys: dict[str, dict[str, Any]] = {
        "opt": {"hidden_size": hidden, "num_hidden_layers": layers, "ffn_dim": 4 * hidden,
                "num_attention_heads": heads, "max_position_embeddings": max_positions, "word_embed_proj_dim": hidden,
                "dropout": 0.0, "attention_dropout": 0.0, "layerdrop": 0.0},
        "gpt2": {"n_embd": hidden, "n_layer": layers, "n_head": heads, "n_positions": max_positions,
                 "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "summary_first_dropout": 0.0},
        "gpt_neox": {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
                     "intermediate_size": 4 * hidden, "max_position_embeddings": max_positions,
                     "hidden_dropout": 0.0, "attention_dropout": 0.0},
        "llama": rope,
        "mistral": dict(rope, sliding_window=None),
        "qwen2": dict(rope, use_sliding_window=False),
        "qwen3": dict(rope, head_dim=hidden // heads, use_sliding_window=False),
        "gemma": dict(rope, head_dim=hidden // heads),
        "gemma2": dict(rope, head_dim=hidden // heads, sliding_window=max_positions),
        "gemma3_text": dict(rope, head_dim=hidden // heads, sliding_window=max_positions),
        "phi3": dict(rope, resid_pdrop=0.0, embd_pdrop=0.0, original_max_position_embeddings=max_positions),
        "mixtral": dict(rope, intermediate_size=hidden, num_local_experts=4, num_experts_per_tok=2,
                        sliding_window=None, router_jitter_noise=0.0),
        "qwen2_moe": dict(rope, **moe, shared_expert_intermediate_size=hidden, use_sliding_window=False),
        "qwen3_moe": dict(rope, **moe, head_dim=hidden // heads, use_sliding_window=False),
        "olmoe": dict(rope, intermediate_size=hidden, num_experts=4, num_experts_per_tok=2),
    }
    if family not in keys:
        raise ValueError(f"tiny model family {family!r}: expected one of {', '.join(TINY_FAMILIES)}")
    return AutoConfig.for_model(family, **keys[family], **ids)


def build_tiny_causal_lm(out_dir: str | Path, tokenizer_dir: str | Path, hidden: int = 64, layers: int = 2,
                         seed: int = 0, family: str = "opt", heads: int = 0) -> Path:
    """A randomly initialised tiny causal LM of ``family`` (:func:`tiny_lm_config`; no dropout, so actor and ref
    agree token for token; 128 positions) saved with its tokenizer to ``out_dir`` (returned as a Path)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from ..checks import load_tokenizer

    tokenizer = load_tokenizer(str(tokenizer_dir))
    config = tiny_lm_config(family, len(tokenizer), hidden, layers, pad_token_id=tokenizer.pad_token_id,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, heads=heads)
    # Seed only a private generator state: the caller's global RNG stream is left as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    logger.info("built tiny %s (%d params) in %s", family, sum(p.numel() for p in model.parameters()), out)
    return out


@functools.cache
def tiny_model_info(hidden: int, layers: int, seed: int = 0, heads: int = 0) -> ModelInfo:
    """The memory planner's view of the random tiny OPT the RLHF recipes build (built in a temporary folder to
    read its headers: it is a few hundred KB)."""
    from multiengine.engines import planner as P

    with tempfile.TemporaryDirectory(prefix="multiengine_plan_") as tmp:
        tok = os.path.join(tmp, "tokenizer")
        train_tokenizer(task_vocabulary(), tok)
        model = build_tiny_causal_lm(os.path.join(tmp, "model"), tok, hidden=hidden, layers=layers, seed=seed,
                                     heads=heads)
        info = P.model_info(str(model))
    return P.ModelInfo(source=f"the recipes' tiny OPT (hidden {hidden}, {layers} layers)", tensors=info.tensors,
                       config=info.config, class_name=info.class_name)


def prepare_builtin(out_dir: str | Path, seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 0,
                    **sizes: int) -> dict[str, Path]:
    """The built-in task's data (``data``: a folder of ``{split}.jsonl``, and each split by name), ``tokenizer`` and
    random tiny ``model`` under ``out_dir``."""
    out = Path(out_dir)
    paths = write_builtin_dataset(out / "data", seed, **sizes)
    train_tokenizer(task_vocabulary(), out / "tokenizer")
    model_dir = build_tiny_causal_lm(out / "model", out / "tokenizer", hidden=hidden, layers=layers, seed=seed,
                                     heads=heads)
    return {"data": out / "data", **paths, "tokenizer": out / "tokenizer", "model": model_dir}

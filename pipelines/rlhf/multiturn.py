"""Multi-turn rollouts with tools: the model and an environment take turns in one token sequence, and only the
model's own tokens are trained on.

Environment interface (:class:`Environment`)::

    reset(prompt: str) -> str                           # the first observation (the user's message)
    step(model_turn: str) -> (reply | None, reward, done)

``step`` gets the decoded text of one model turn. ``done=True`` ends the episode (``reply`` is then ignored);
otherwise ``reply`` (``None`` = an empty reply) becomes the next environment turn and the model speaks again.
The episode's reward is the sum of the step rewards.

Tool-call convention: the model calls the calculator by writing ``<calc>EXPRESSION</calc>`` in its turn; the
environment answers ``<result>VALUE</result>`` in a turn of role ``tool`` (:class:`TurnRenderer`). A turn
without a tool call is the model's final answer (``<answer>N</answer>``, or the last number it wrote).

Token layout. :func:`multiturn_rollout` keeps the exact tokens the generator produced for each model turn and
appends the environment's turns as tokens rendered by :class:`TurnRenderer`: through the tokenizer's chat
template when it has one (the text between the end of an assistant turn and the next assistant header), as
plain text otherwise. The stored sequence is exactly what the model was conditioned on while sampling, so
log-probs recomputed on it match the sampler's. ``action_mask`` is 1 on the model's tokens only (the prompt,
the chat markup around turns and the tool replies are 0), so a loss masked with it sends no gradient into
the environment's tokens' log-probs.

Reproducibility: ``seed`` seeds torch's global generator before the first turn (as ``rollout.make_experience``
does), so any torch sampler, ``transformers.generate`` included, repeats a rollout from its seed.
"""

from __future__ import annotations

import ast
import math
import operator
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from multiengine.engines import moe
from multiengine.engines.settings import config_problem

if TYPE_CHECKING:
    from .grpo import GRPOSettings
    from .rollout import RolloutSpec

__all__ = ["ANSWER_RE", "BUILTIN_ENVS", "TOOL_CALL_RE", "ArithmeticEnv", "CalculatorError", "Environment",
           "MultiTurnRollout", "MultiTurnRollouts", "TurnRenderer", "arithmetic_prompts", "arithmetic_rows",
           "arithmetic_vocabulary", "check_env_settings", "collate_rollouts", "environment_factory", "episode_figures",
           "evaluate_multiturn", "format_number", "multiturn_rollout", "multiturn_rollouts", "prepare_arithmetic",
           "prepare_arithmetic_assets", "registry_rollouts", "rollout_seed", "safe_calculate", "sampling_generate",
           "to_experience_layout"]

TOOL_CALL_RE = re.compile(r"<calc>(.*?)</calc>", re.S)
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.S)
_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")

Generate = Callable[[list[int], int], Sequence[int]]


class Environment(Protocol):
    """What :func:`multiturn_rollout` talks to (module docstring)."""

    def reset(self, prompt: str) -> str: ...

    def step(self, model_turn: str) -> tuple[str | None, float, bool]: ...


# ------------------------------------------------------------------------------------------------------------
# a safe calculator: arithmetic on number literals only, parsed with ast, never eval'd
# ------------------------------------------------------------------------------------------------------------


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate."""


_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_CHARS = 200
_MAX_EXPONENT = 64
_MAX_MAGNITUDE = 1e15


def _eval_node(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval_node(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalculatorError(f"only numbers are allowed, got {node.value!r}")
        value = node.value
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval_node(node.left), _eval_node(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > _MAX_EXPONENT or abs(left) > _MAX_MAGNITUDE):
            raise CalculatorError(f"exponent {right} is too large (at most {_MAX_EXPONENT})")
        try:
            value = _BINOPS[type(node.op)](left, right)
        except ZeroDivisionError as err:
            raise CalculatorError("division by zero") from err
        if isinstance(value, complex):
            raise CalculatorError("the result is not a real number")
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value = _UNARY[type(node.op)](_eval_node(node.operand))
    else:
        raise CalculatorError(f"{type(node).__name__} is not allowed: use numbers, + - * / // % ** and parentheses")
    if (isinstance(value, float) and not math.isfinite(value)) or abs(value) > _MAX_MAGNITUDE:
        raise CalculatorError(f"a value exceeds {_MAX_MAGNITUDE:g} in magnitude")
    return value


def safe_calculate(expression: str) -> int | float:
    """The value of an arithmetic expression: number literals, ``+ - * / // % **`` (exponent at most 64 in
    magnitude), unary ``+ -`` and parentheses; at most 200 characters and values at most 1e15 in magnitude.
    Anything else (names, calls, attributes, strings, subscripts, comparisons) raises :class:`CalculatorError`:
    the expression is parsed with ``ast`` and walked, never passed to ``eval``."""
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    expression = expression.strip()
    if not expression:
        raise CalculatorError("empty expression")
    if len(expression) > _MAX_CHARS:
        raise CalculatorError(f"expression longer than {_MAX_CHARS} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as err:
        raise CalculatorError(f"not an arithmetic expression: {expression!r}") from err
    return _eval_node(tree)


def format_number(value: int | float) -> str:
    """``15`` for integral values, else up to 6 significant digits."""
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return f"{value:.6g}"


# ------------------------------------------------------------------------------------------------------------
# a tiny verifiable task: arithmetic with a calculator tool
# ------------------------------------------------------------------------------------------------------------


_PROMPT_RE = re.compile(r"compute\s+(.+?)\s*$", re.S)


class ArithmeticEnv:
    """``reset("compute 12 + 7 * 3")`` -> the prompt itself; the answer is the expression's value (checked with
    :func:`safe_calculate`, so every task is verifiable).

    ``step(turn)``: a turn with ``<calc>EXPR</calc>`` gets ``<result> VALUE </result>`` (or ``<result> error:
    ... </result>``), reward 0, not done, up to ``max_tool_calls`` calls (one more ends the episode with reward
    0); a turn without a call is the final answer: reward 1 if ``<answer>N</answer>`` (or, without the tags, the
    last number in the turn) equals the value, else 0, done. Tokens in replies are space separated, so a
    word-level tokenizer reads them.
    """

    def __init__(self, max_tool_calls: int = 2) -> None:
        if max_tool_calls < 0:
            raise ValueError(f"max_tool_calls must be >= 0, got {max_tool_calls}")
        self.max_tool_calls = max_tool_calls
        self.answer: int | float | None = None
        self.tool_calls = 0

    def reset(self, prompt: str) -> str:
        match = _PROMPT_RE.search(prompt)
        if match is None:
            raise ValueError(f"arithmetic prompt {prompt!r}: expected 'compute EXPRESSION'.")
        self.answer = safe_calculate(match.group(1))
        self.tool_calls = 0
        return prompt

    def step(self, model_turn: str) -> tuple[str | None, float, bool]:
        if self.answer is None:
            raise RuntimeError("ArithmeticEnv.step before reset")
        call = TOOL_CALL_RE.search(model_turn)
        if call is not None:
            self.tool_calls += 1
            if self.tool_calls > self.max_tool_calls:
                return None, 0.0, True
            try:
                result = format_number(safe_calculate(call.group(1)))
            except CalculatorError as err:
                result = f"error: {err}"
            return f"<result> {result} </result>", 0.0, False
        tagged = ANSWER_RE.search(model_turn)
        numbers = _NUMBER_RE.findall(tagged.group(1) if tagged else model_turn)
        correct = bool(numbers) and math.isclose(float(numbers[-1]), float(self.answer), rel_tol=0.0, abs_tol=1e-9)
        return None, 1.0 if correct else 0.0, True


def arithmetic_prompts(n: int, seed: int = 0, max_operand: int = 20, ops: str = "+-*") -> list[str]:
    """``n`` prompts ``"compute A op B"`` with operands in ``[0, max_operand]``, reproducible from ``seed``."""
    rng = random.Random(seed)
    return [f"compute {rng.randint(0, max_operand)} {rng.choice(ops)} {rng.randint(0, max_operand)}" for _ in range(n)]


# ------------------------------------------------------------------------------------------------------------
# rendering turns as tokens
# ------------------------------------------------------------------------------------------------------------


_PLACEHOLDER = "\u2063MODEL_TURN\u2063"


class TurnRenderer:
    """Token ids of the first observation and of each environment turn.

    With a chat template (``use_chat_template=None``: when the tokenizer has one): the first observation is
    ``apply_chat_template([user], add_generation_prompt=True)``; an environment turn is the text the template
    puts between the content of an assistant turn and the next assistant header, with the reply as a message
    of role ``env_role`` (``tool``; use ``user`` for a template without a tool role). If the model's turn ended
    with the EOS token and the template closes assistant turns with the EOS text, that part is not repeated.
    Without a chat template: ``observation + "\\n"`` (with the tokenizer's special tokens, e.g. BOS) and
    ``"\\n" + reply + "\\n"``.
    """

    def __init__(self, tokenizer: Any, env_role: str = "tool", use_chat_template: bool | None = None) -> None:
        self.tokenizer = tokenizer
        self.env_role = env_role
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if use_chat_template and not has_template:
            raise ValueError("use_chat_template=True but the tokenizer has no chat template; set one or pass "
                             "use_chat_template=False (plain text turns).")
        self.chat = has_template if use_chat_template is None else use_chat_template
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        self._eos_text = getattr(tokenizer, "eos_token", None) or ""

    def _encode(self, text: str, special: bool = False) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except Exception as err:  # templates raise their own errors (e.g. an unknown role)
            roles = [m["role"] for m in messages]
            raise ValueError(f"the chat template cannot render roles {roles} ({err}); with a template that has no "
                             f"{self.env_role!r} role use TurnRenderer(env_role='user').") from err

    def first(self, observation: str) -> list[int]:
        if not self.chat:
            return self._encode(observation + "\n", special=True)
        return self._encode(self._render([{"role": "user", "content": observation}], True))

    def env_turn(self, reply: str, model_ids: Sequence[int]) -> list[int]:
        """Tokens appended after a model turn ``model_ids`` for the environment's ``reply``."""
        if not self.chat:
            return self._encode("\n" + reply + "\n")
        convo = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _PLACEHOLDER}]
        before = self._render(convo, False)
        after = self._render(convo + [{"role": self.env_role, "content": reply}], True)
        if not after.startswith(before) or _PLACEHOLDER not in before:
            raise ValueError("the chat template renders earlier turns differently once a turn is added, so the "
                             "environment's turn cannot be appended as tokens; use TurnRenderer(use_chat_template="
                             "False) or a template that only appends.")
        closing = before[before.rindex(_PLACEHOLDER) + len(_PLACEHOLDER):]
        ended = len(model_ids) > 0 and self.eos_token_id is not None and int(model_ids[-1]) == self.eos_token_id
        stripped = closing.lstrip()
        if ended and self._eos_text and stripped.startswith(self._eos_text):
            closing = stripped[len(self._eos_text):]  # the model already wrote the end of its turn
        return self._encode(closing + after[len(before):])


# ------------------------------------------------------------------------------------------------------------
# the rollout
# ------------------------------------------------------------------------------------------------------------


@dataclass
class MultiTurnRollout:
    """One episode. Tensors are 1-D over the whole sequence (first observation, model and environment turns)."""

    input_ids: torch.Tensor  # [L] long
    action_mask: torch.Tensor  # [L] bool: the model's own tokens
    prompt_length: int  # tokens of the first observation
    reward: float  # sum of the step rewards
    step_rewards: list[float] = field(default_factory=list)
    turns: int = 0  # model turns taken
    done: bool = False  # the environment ended the episode
    stop: str = ""  # "done" | "max_turns" | "max_total_tokens"
    model_turns: list[str] = field(default_factory=list)
    env_turns: list[str] = field(default_factory=list)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.ones_like(self.input_ids)


def rollout_seed(seed: int, index: int) -> int:
    """The seed of prompt ``index``'s rollout (independent of the other prompts of the batch)."""
    return (int(seed) * 1_000_003 + int(index) * 7919 + 12_345) % (2**63 - 1)


def _cut_after_eos(ids: Sequence[int], eos_token_id: int | None) -> list[int]:
    out = [int(i) for i in ids]
    if eos_token_id is not None and eos_token_id in out:
        out = out[:out.index(eos_token_id) + 1]
    return out


def multiturn_rollout(
    prompt: str,
    env: Environment,
    generate: Generate,
    renderer: TurnRenderer,
    *,
    max_turns: int = 4,
    max_total_tokens: int = 256,
    max_new_tokens: int = 64,
    seed: int | None = None,
) -> MultiTurnRollout:
    """One episode: model and environment turns alternate until the environment says done or a cap is reached.
    ``env.reset(prompt)`` gives the first turn; ``generate(ids, max_new_tokens) -> new ids`` is any model or engine
    (whatever follows the first EOS, ``renderer.tokenizer.eos_token_id``, or exceeds ``max_new_tokens`` is dropped).
    Caps: ``max_turns`` model turns, ``max_total_tokens`` for the whole sequence, prompt included (a model turn gets
    at most the room left; an environment turn that leaves no room for another model token ends the episode),
    ``max_new_tokens`` per model turn. ``seed`` seeds torch's global generator first (module docstring; None leaves
    it alone)."""
    if max_turns < 1:
        raise ValueError(f"max_turns={max_turns!r}: the number of model turns per episode, >= 1.")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: tokens per model turn, >= 1.")
    if seed is not None:
        torch.manual_seed(seed)
    observation = env.reset(prompt)
    ids = renderer.first(observation)
    if len(ids) >= max_total_tokens:
        raise ValueError(f"the first observation is {len(ids)} tokens, which leaves no room under max_total_tokens="
                         f"{max_total_tokens}; raise max_total_tokens or shorten the prompt.")
    mask = [False] * len(ids)
    out = MultiTurnRollout(input_ids=torch.empty(0, dtype=torch.long), action_mask=torch.empty(0, dtype=torch.bool),
                           prompt_length=len(ids), reward=0.0, stop="max_turns")
    eos = renderer.eos_token_id
    decode = renderer.tokenizer.decode
    while out.turns < max_turns:
        budget = min(max_new_tokens, max_total_tokens - len(ids))
        new = _cut_after_eos(list(generate(list(ids), budget))[:budget], eos)
        ids += new
        mask += [True] * len(new)
        out.turns += 1
        text = decode(new, skip_special_tokens=True)
        out.model_turns.append(text)
        reply, reward, done = env.step(text)
        out.step_rewards.append(float(reward))
        if done:
            out.done, out.stop = True, "done"
            break
        if len(ids) >= max_total_tokens:
            out.stop = "max_total_tokens"
            break
        if out.turns >= max_turns:  # no model turn follows: the reply would be trained on by nobody
            break
        env_ids = renderer.env_turn(reply or "", new)
        if len(ids) + len(env_ids) >= max_total_tokens:
            out.stop = "max_total_tokens"
            break
        ids += env_ids
        mask += [False] * len(env_ids)
        out.env_turns.append(reply or "")
    out.input_ids = torch.tensor(ids, dtype=torch.long)
    out.action_mask = torch.tensor(mask, dtype=torch.bool)
    out.reward = float(sum(out.step_rewards))
    return out


def multiturn_rollouts(
    prompts: Sequence[str],
    make_env: Callable[[], Environment],
    generate: Generate,
    renderer: TurnRenderer,
    *,
    seed: int,
    **caps: int,
) -> list[MultiTurnRollout]:
    """One :func:`multiturn_rollout` per prompt, each with a fresh ``make_env()`` and seeded with
    :func:`rollout_seed` ``(seed, index)``: a prompt's episode does not depend on the others. ``caps``:
    ``max_turns``, ``max_total_tokens``, ``max_new_tokens``."""
    return [multiturn_rollout(p, make_env(), generate, renderer, seed=rollout_seed(seed, i), **caps)
            for i, p in enumerate(prompts)]


def sampling_generate(module: Any, eos_token_id: int | None, temperature: float = 1.0,
                      do_sample: bool = True) -> Generate:
    """A ``generate(ids, max_new_tokens)`` for a causal LM ``module`` (``module(input_ids=...).logits``): one token
    at a time from ``softmax(logits / temperature)`` with torch's global generator (greedy with
    ``do_sample=False``), stopping after EOS. No KV cache: meant for tiny models and tests."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")

    @torch.no_grad()
    def generate(ids: list[int], max_new_tokens: int) -> list[int]:
        device = next(module.parameters()).device
        seq = torch.tensor([ids], dtype=torch.long, device=device)
        new: list[int] = []
        for _ in range(max_new_tokens):
            logits = module(input_ids=seq).logits[0, -1].float()
            if do_sample:
                token = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1))
            else:
                token = int(logits.argmax())
            new.append(token)
            if token == eos_token_id:
                break
            seq = torch.cat([seq, seq.new_tensor([[token]])], dim=1)
        return new

    return generate


# ------------------------------------------------------------------------------------------------------------
# batching
# ------------------------------------------------------------------------------------------------------------


def collate_rollouts(rollouts: Sequence[MultiTurnRollout], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: ``input_ids``, ``attention_mask``, ``action_mask`` ``[B, L_max]`` and ``rewards [B]``.
    For a loss: the logits at ``t`` predict token ``t + 1``, so use ``action_mask[:, 1:]`` with ``logits[:, :-1]``."""
    if not rollouts:
        raise ValueError("collate_rollouts needs at least one rollout")
    L = max(int(r.input_ids.numel()) for r in rollouts)
    B = len(rollouts)
    ids = torch.full((B, L), pad_token_id, dtype=torch.long)
    attention = torch.zeros(B, L, dtype=torch.long)
    action = torch.zeros(B, L, dtype=torch.bool)
    for i, r in enumerate(rollouts):
        n = int(r.input_ids.numel())
        ids[i, :n] = r.input_ids
        attention[i, :n] = 1
        action[i, :n] = r.action_mask
    rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
    return {"input_ids": ids, "attention_mask": attention, "action_mask": action, "rewards": rewards}


def to_experience_layout(rollouts: Sequence[MultiTurnRollout], pad_token_id: int) -> dict[str, Any]:
    """The layout of ``rollout.Experience``: the first observations left padded to ``C`` columns, then everything
    after them (model and environment turns) right padded to ``T``.

    Returns:
        ``sequences [B, C + T]``, ``attention_mask [B, C + T]`` (every real token, environment turns included),
        ``context_length`` ``C``, ``action_mask [B, T]`` bool (the model's tokens; unlike a single-turn rollout
        not a prefix mask) and ``score [B]``.
    """
    if not rollouts:
        raise ValueError("to_experience_layout needs at least one rollout")
    C = max(r.prompt_length for r in rollouts)
    T = max(int(r.input_ids.numel()) - r.prompt_length for r in rollouts)
    B = len(rollouts)
    seq = torch.full((B, C + T), pad_token_id, dtype=torch.long)
    attention = torch.zeros(B, C + T, dtype=torch.long)
    action = torch.zeros(B, T, dtype=torch.bool)
    for i, r in enumerate(rollouts):
        p, rest = r.prompt_length, int(r.input_ids.numel()) - r.prompt_length
        seq[i, C - p:C] = r.input_ids[:p]
        attention[i, C - p:C] = 1
        seq[i, C:C + rest] = r.input_ids[p:]
        attention[i, C:C + rest] = 1
        action[i, :rest] = r.action_mask[p:]
    score = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
    return {"sequences": seq, "attention_mask": attention, "context_length": C, "action_mask": action, "score": score}


# ------------------------------------------------------------------------------------------------------------
# the arithmetic task as a built-in data set, and the multi-turn rollout on the registry (rlhf_grpo's grpo.env)
# ------------------------------------------------------------------------------------------------------------

BUILTIN_ENVS = ("builtin:arithmetic",)
_TAGS = ("<calc>", "</calc>", "<result>", "</result>", "<answer>", "</answer>", "error:")


def environment_factory(spec: str) -> Callable[[], Environment]:
    """A fresh environment per episode from ``spec``: ``builtin:arithmetic`` (:class:`ArithmeticEnv`) or
    ``module:callable`` (any importable zero-argument factory returning an :class:`Environment`)."""
    if spec == "builtin:arithmetic":
        return ArithmeticEnv
    if spec.startswith("builtin:") or ":" not in spec:
        raise ValueError(f"grpo.env={spec!r}: use one of {list(BUILTIN_ENVS)} or 'module:factory' (an importable "
                         "zero-argument callable that returns an environment with reset(prompt) and step(turn)).")
    import importlib

    module, _, name = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"grpo.env={spec!r}: cannot import {name} from {module} ({err}).") from err
    if not callable(factory):
        raise ValueError(f"grpo.env={spec!r}: {name} is not callable.")
    return factory


def arithmetic_vocabulary(max_operand: int = 20) -> list[str]:
    """Every word of the arithmetic task (prompts, calls, results and answers of ``+ - *`` on operands in
    ``[0, max_operand]``), so a word-level tokenizer never needs ``<unk>``."""
    numbers = {str(v) for v in range(-max_operand, max_operand * max_operand + 1)}
    return sorted(numbers | {"compute", "+", "-", "*", *_TAGS})


def arithmetic_rows(n: int, seed: int, tool_fraction: float = 0.5, max_operand: int = 20) -> list[dict[str, str]]:
    """SFT demonstrations of the calculator convention as ``{prompt, response}`` rows, reproducible from ``seed``.

    A prompt either gets a tool episode, split into its two model turns (``compute 3 + 4`` ->
    ``<calc> 3 + 4 </calc>``, and the prompt with that turn, its EOS and the tool's reply ->
    ``<answer> 7 </answer>``), with probability ``tool_fraction``, or a direct answer (``<answer> 7 </answer>``
    right away). A tiny model copies numbers well but cannot add or multiply, so direct answers mostly fail:
    RL has room to learn to call the calculator."""
    rng = random.Random(seed)
    rows = []
    for prompt in arithmetic_prompts(n, seed=rng.randrange(2**31), max_operand=max_operand):
        expr = prompt.removeprefix("compute ")
        value = format_number(safe_calculate(expr))
        if rng.random() < tool_fraction:
            call = f"<calc> {expr} </calc>"
            rows.append({"prompt": prompt, "response": call})
            rows.append({"prompt": f"{prompt} {call} </s> <result> {value} </result>",
                         "response": f"<answer> {value} </answer>"})
        else:
            rows.append({"prompt": prompt, "response": f"<answer> {value} </answer>"})
    return rows


def prepare_arithmetic(root: str, seed: int = 0, hidden: int = 64, layers: int = 2, n_sft: int = 2000,
                       n_prompts: int = 1000, n_eval: int = 256, heads: int = 0) -> dict[str, str]:
    """The arithmetic task under ``root``: ``data/{sft,ppo,eval}.jsonl`` (demonstrations, training prompts,
    held-out prompts), a word-level tokenizer (:func:`arithmetic_vocabulary`, no chat template: turns are plain
    text) and a random tiny OPT. Call on one rank; returns the paths."""
    import json
    import os

    from . import tiny

    data = os.path.join(root, "data")
    os.makedirs(data, exist_ok=True)
    prompts = arithmetic_prompts(n_prompts + n_eval, seed=seed + 1)
    # the held-out rows carry a first turn too: the SFT run's held-out loss reads them
    splits = {"sft": arithmetic_rows(n_sft, seed), "ppo": [{"prompt": p} for p in prompts[:n_prompts]],
              "eval": [{"prompt": p, "response": f"<calc> {p.removeprefix('compute ')} </calc>"}
                       for p in prompts[n_prompts:]]}
    for split, rows in splits.items():
        with open(os.path.join(data, f"{split}.jsonl"), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    tokenizer, model = os.path.join(root, "tokenizer"), os.path.join(root, "model")
    tiny.train_tokenizer(arithmetic_vocabulary(), tokenizer, vocab_size=1024)
    tiny.build_tiny_causal_lm(model, tokenizer, hidden=hidden, layers=layers, seed=seed, heads=heads)
    return {"data": data, "tokenizer": tokenizer, "model": model}


def _engine_generate(module: Any, eos: int, pad: int, temperature: float, top_k: int, top_p: float,
                     do_sample: bool) -> Generate:
    off = moe.router_logits_off(module)  # an MoE config's output_router_logits would break cached decoding

    @torch.no_grad()
    def generate(ids: list[int], max_new_tokens: int) -> list[int]:
        device = next(module.parameters()).device
        x = torch.tensor([ids], dtype=torch.long, device=device)
        kwargs: dict[str, Any] = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, eos_token_id=eos,
                                      pad_token_id=pad, use_cache=True)
        if do_sample:
            kwargs.update(temperature=temperature, top_k=top_k, top_p=top_p)
        out = module.generate(input_ids=x, attention_mask=torch.ones_like(x), **off, **kwargs)
        return out[0, len(ids):].tolist()

    return generate


def registry_rollouts(registry: Any, prompts: Sequence[str], make_env: Callable[[], Environment],
                      renderer: TurnRenderer, generation: Any, *, seed: int, max_turns: int, max_total_tokens: int,
                      actor: str = "actor") -> list[MultiTurnRollout]:
    """:func:`multiturn_rollouts` with the actor of ``registry`` (``generation``: a ``GenerationSettings``).

    Collective in a fixed way: the actor is gathered once for all episodes (``generation.mode="gather"``), so a
    rank whose episodes take more turns runs more local forwards without the others waiting on it. A ZeRO-3
    actor with ``mode="per_token"`` on several ranks is refused (each token would be a collective, and the
    ranks' turn counts differ)."""
    caps = dict(seed=seed, max_turns=max_turns, max_total_tokens=max_total_tokens,
                max_new_tokens=generation.max_new_tokens)
    if generation.engine == "vllm":  # one request per turn, seeded from the episode's torch RNG
        from .generation import vllm_sampling

        engine, sampling = registry.rollout(actor), vllm_sampling(generation)
        return multiturn_rollouts(prompts, make_env, lambda ids, n: engine.generate(
            [ids], n, sampling, [int(torch.randint(0, 2**31 - 1, ()))], [renderer.eos_token_id])[0][0], renderer,
            **caps)
    role = registry.role(actor)
    if generation.mode != "gather" and role.stage == 3 and registry.world_size > 1:
        raise ValueError("multi-turn rollouts need generation.mode=gather with a ZeRO-3 actor on several ranks: "
                         "episodes take different numbers of turns per rank, so per-token collectives would hang.")
    with registry.generation(actor, gather=generation.mode == "gather") as module:
        was_training = module.training
        module.eval()
        gen = _engine_generate(module, renderer.eos_token_id, renderer.tokenizer.pad_token_id, generation.temperature,
                               generation.top_k, generation.top_p, generation.do_sample)
        try:
            return multiturn_rollouts(prompts, make_env, gen, renderer, **caps)
        finally:
            module.train(was_training)


def episode_figures(rollouts: Sequence[MultiTurnRollout]) -> dict[str, torch.Tensor]:
    """Per-episode figures reported as step means: ``multiturn/success`` (reward > 0), ``multiturn/turns``
    (model turns), ``multiturn/tool_calls`` (environment replies) and ``multiturn/capped`` (ended by a cap)."""
    return {"multiturn/success": torch.tensor([float(r.reward > 0) for r in rollouts], dtype=torch.float64),
            "multiturn/turns": torch.tensor([float(r.turns) for r in rollouts], dtype=torch.float64),
            "multiturn/tool_calls": torch.tensor([float(len(r.env_turns)) for r in rollouts], dtype=torch.float64),
            "multiturn/capped": torch.tensor([float(not r.done) for r in rollouts], dtype=torch.float64)}


class MultiTurnRollouts:
    """``GRPOTrainer``'s ``rollout`` with ``settings.env`` (a GRPOSettings): ``n_samples_per_prompt`` episodes per
    prompt (consecutive rows) of at most ``max_turns`` model turns and ``max_total_tokens`` tokens, the log-probs
    of ``spec.actor`` and ``spec.ref`` (None: no ref) on the whole token sequence (one forward per role, every rank)
    and the environment's reward as the score. Only the model's tokens are actions (:func:`to_experience_layout`)."""

    def __init__(self, registry: Any, settings: GRPOSettings, renderer: TurnRenderer, spec: RolloutSpec) -> None:
        self.registry, self.renderer, self.spec = registry, renderer, spec
        self.make_env = environment_factory(settings.env)
        self.n, self.max_turns, self.max_total_tokens = (settings.n_samples_per_prompt, settings.max_turns,
                                                         settings.max_total_tokens)

    def episodes(self, prompts: Sequence[str], seed: int) -> list[MultiTurnRollout]:
        return registry_rollouts(self.registry, prompts, self.make_env, self.renderer, self.spec.generation,
                                 seed=seed, max_turns=self.max_turns, max_total_tokens=self.max_total_tokens,
                                 actor=self.spec.actor)

    @torch.no_grad()
    def __call__(self, batch: dict[str, Any], step: int, seed: int) -> Any:
        import time

        from .generation import rollout_done
        from .rollout import Experience
        from .scoring import role_logprobs

        registry, spec = self.registry, self.spec
        prompts = [p for p in batch["prompts"] for _ in range(self.n)]
        t0 = time.perf_counter()
        rollouts = self.episodes(prompts, seed)
        t_gen = time.perf_counter() - t0
        sync = rollout_done(registry, spec.actor) if spec.generation.engine == "vllm" else {}
        layout = to_experience_layout(rollouts, self.renderer.tokenizer.pad_token_id)
        seq = layout["sequences"].to(registry.device)
        attention = layout["attention_mask"].to(registry.device)
        action = layout["action_mask"].to(registry.device)
        C, action_f = layout["context_length"], action.float()
        temperature = spec.generation.temperature
        logprobs = role_logprobs(registry, spec.actor, seq, attention, C, temperature) * action_f \
            if spec.old_logprobs else None
        ref_logprobs = None
        if spec.ref is not None:
            ref_logprobs = role_logprobs(registry, spec.ref, seq, attention, C, temperature) * action_f
        score = layout["score"].to(registry.device)
        return Experience(
            sequences=seq, attention_mask=attention, context_length=C, action_mask=action, logprobs=logprobs,
            score=score, ref_logprobs=ref_logprobs, reward_parts={"env": score.clone()}, prompts=prompts,
            responses=[" | ".join(r.model_turns) for r in rollouts], group_size=self.n,
            extras=episode_figures(rollouts),
            timings={"generation_s": t_gen, "experience_s": time.perf_counter() - t0 - t_gen,
                     "generation_steps": float(sum(int(r.action_mask.sum()) for r in rollouts)), **sync})


def evaluate_multiturn(rollouts: MultiTurnRollouts, batches: Sequence[dict[str, Any]], seed: int) -> dict[str, float]:
    """Sampled episodes on the evaluation prompts (one per prompt, batch ``i`` seeded with ``seed + i``), over all
    ranks (collective: every rank must hold the same number of batches): ``success``, ``reward``, ``turns``,
    ``tool_calls``."""
    from multiengine.engines import all_reduce_sum

    totals = torch.zeros(5, dtype=torch.float64)
    for i, batch in enumerate(batches):
        episodes = rollouts.episodes(batch["prompts"], seed + i)
        fig = episode_figures(episodes)
        totals += torch.tensor([float(fig["multiturn/success"].sum()), sum(r.reward for r in episodes),
                                float(fig["multiturn/turns"].sum()), float(fig["multiturn/tool_calls"].sum()),
                                float(len(episodes))], dtype=torch.float64)
    totals = all_reduce_sum(totals)
    n = max(float(totals[4]), 1.0)
    return {"success": float(totals[0]) / n, "reward": float(totals[1]) / n, "turns": float(totals[2]) / n,
            "tool_calls": float(totals[3]) / n}


def prepare_arithmetic_assets(root: str, registry: Any, seed: int = 0, hidden: int = 64, layers: int = 2,
                              heads: int = 0) -> dict[str, str]:
    """:func:`prepare_arithmetic` under ``root`` on rank 0 on first use (the others wait at a barrier)."""
    import os

    from multiengine.engines import barrier

    paths = {k: os.path.join(root, k) for k in ("data", "tokenizer", "model")}
    done = os.path.join(root, ".complete")
    if registry.is_main and not os.path.isfile(done):
        prepare_arithmetic(root, seed=seed, hidden=hidden, layers=layers, heads=heads)
        with open(done, "w") as f:
            f.write("ok\n")
    barrier()
    return paths


def check_env_settings(env: str, has_rewards: bool, generation_mode: str) -> None:
    """The settings of other sections ``grpo.env`` needs: an environment that loads, its reward alone (no
    reward.models / reward.functions) and gathered generation (episodes take a different number of turns on each
    rank, so per-token collectives would hang). Raises a SettingsError naming the key and the fix."""
    try:
        environment_factory(env)
    except ValueError as err:
        raise config_problem("grpo.env", env, "cannot be loaded", str(err)) from None
    if has_rewards:
        raise config_problem("grpo.env", env, "scores episodes with the environment's reward alone", "set "
                             "reward.models=[] and reward.functions=[] (or grpo.env=\"\" for single answers)")
    if generation_mode != "gather":
        raise config_problem("generation.mode", generation_mode, f"cannot run grpo.env={env!r} episodes: they take a "
                             "different number of turns on each rank, so per-token collectives would hang",
                             "use generation.mode=gather")

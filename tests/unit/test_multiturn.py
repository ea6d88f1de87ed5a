"""Multi-turn rollouts with a calculator tool (pipelines/rlhf/multiturn.py): the safe calculator, the arithmetic
environment, the token layout and its action mask (hand-built), the caps, reproducibility from the seed, and
that a policy-gradient loss masked with the action mask sends no gradient to the environment's tokens."""

from __future__ import annotations

import builtins

import pytest
import torch
from multiengine.pipelines.rlhf import losses, ppo
from multiengine.pipelines.rlhf import multiturn as mt
from multiengine.pipelines.rlhf.generation import position_ids_from_mask
from multiengine.pipelines.rlhf.grpo import GRPOSettings
from multiengine.pipelines.rlhf.tiny import CHAT_ROLE_TOKENS, tiny_lm_config, train_tokenizer

WORDS = ["compute", "+", "-", "*", "<calc>", "</calc>", "<result>", "</result>", "<answer>", "</answer>", "error:"] + \
    [str(i) for i in range(60)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    t = train_tokenizer([" ".join(WORDS)], tmp_path_factory.mktemp("mt_tok"), chat_template=True)
    t.add_special_tokens({"additional_special_tokens": list(CHAT_ROLE_TOKENS) + ["<|tool|>"]})
    return t


@pytest.fixture(scope="module")
def model(tok):
    from transformers import AutoModelForCausalLM

    config = tiny_lm_config("llama", len(tok), hidden=32, layers=1, pad_token_id=tok.pad_token_id,
                            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config).eval()


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def scripted(turns: list[list[int]], budgets: list[int] | None = None):
    """A generate callable that returns the given turns in order (then repeats the last one)."""
    state = {"i": 0}

    def generate(context: list[int], max_new_tokens: int) -> list[int]:
        if budgets is not None:
            budgets.append((len(context), max_new_tokens))
        out = turns[min(state["i"], len(turns) - 1)]
        state["i"] += 1
        return out

    return generate


# --------------------------------------------------------------------------------------------------
# calculator and environment
# --------------------------------------------------------------------------------------------------


def test_safe_calculate_values(monkeypatch):
    def forbidden(*_a, **_k):
        raise AssertionError("the calculator must not call eval or exec")

    for name in ("eval", "exec"):  # (ast.parse compiles to a tree, which is allowed)
        monkeypatch.setattr(builtins, name, forbidden)
    assert mt.safe_calculate("2 + 3 * 4") == 14
    assert mt.safe_calculate("(2 + 3) * 4") == 20
    assert mt.safe_calculate("-3 ** 2") == -9
    assert mt.safe_calculate("7 / 2") == 3.5
    assert mt.safe_calculate(" 2 ** 10 ") == 1024
    assert mt.safe_calculate("17 // 5 + 17 % 5") == 5
    assert mt.format_number(6.0) == "6" and mt.format_number(1 / 3) == "0.333333"


@pytest.mark.parametrize("expr", [
    "__import__('os').system('true')", "x + 1", "abs(-1)", "(1).real", "[1][0]", "'a' * 3", "True + 1",
    "1 if 1 else 2", "1 < 2", "lambda: 1", "2 ** 1000", "9 ** 9 ** 9", "10 ** 20", "1e400", "1 / 0", "0 ** -1",
    "(-8) ** 0.5", "", "1 +", "1" * 201, "()",
])
def test_safe_calculate_refuses(expr):
    with pytest.raises(mt.CalculatorError):
        mt.safe_calculate(expr)


def test_arithmetic_env():
    env = mt.ArithmeticEnv(max_tool_calls=1)
    assert env.reset("compute 12 + 7 * 3") == "compute 12 + 7 * 3"
    assert env.step("let me check <calc> 7 * 3 </calc>") == ("<result> 21 </result>", 0.0, False)
    assert env.step("<calc> 1 </calc>") == (None, 0.0, True)  # over the tool-call budget
    env.reset("compute 12 + 7 * 3")
    assert env.step("<calc> os.system(1) </calc>")[0].startswith("<result> error:")
    assert env.step("<answer> 33 </answer>") == (None, 1.0, True)
    env.reset("compute 4 - 9")
    assert env.step("it is 3 or maybe -5") == (None, 1.0, True)  # the last number, without tags
    env.reset("compute 4 - 9")
    assert env.step("<answer> 5 </answer> -5") == (None, 0.0, True)  # the tagged answer wins
    with pytest.raises(ValueError, match="compute EXPRESSION"):
        env.reset("what is 2 + 2")
    prompts = mt.arithmetic_prompts(5, seed=1)
    assert prompts == mt.arithmetic_prompts(5, seed=1) and all(p.startswith("compute ") for p in prompts)


# --------------------------------------------------------------------------------------------------
# token layout and mask
# --------------------------------------------------------------------------------------------------


def test_mask_covers_exactly_the_model_tokens_chat_template(tok):
    eos = tok.eos_token_id
    turn1 = ids(tok, "<calc> 2 + 3 </calc>") + [eos, tok.pad_token_id, tok.pad_token_id]  # padding after EOS is cut
    turn2 = ids(tok, "<answer> 5 </answer>") + [eos]
    r = mt.multiturn_rollout("compute 2 + 3", mt.ArithmeticEnv(), scripted([turn1, turn2]), mt.TurnRenderer(tok))
    tokens = tok.convert_ids_to_tokens(r.input_ids.tolist())
    assert tokens == ["<s>", "<|user|>", "compute", "2", "+", "3", "<|assistant|>",  # first observation
                      "<calc>", "2", "+", "3", "</calc>", "</s>",  # model
                      "<|tool|>", "<result>", "5", "</result>", "<|assistant|>",  # tool turn
                      "<answer>", "5", "</answer>", "</s>"]  # model
    assert r.action_mask.int().tolist() == [0] * 7 + [1] * 6 + [0] * 5 + [1] * 4
    assert (r.reward, r.turns, r.done, r.stop, r.prompt_length) == (1.0, 2, True, "done", 7)
    assert r.step_rewards == [0.0, 1.0] and r.env_turns == ["<result> 5 </result>"]


def test_mask_plain_text_and_a_turn_cut_before_eos(tok):
    turn1 = ids(tok, "<calc> 2 * 3 </calc>")  # no EOS
    turn2 = ids(tok, "<answer> 6 </answer>") + [tok.eos_token_id]
    plain = mt.multiturn_rollout("compute 2 * 3", mt.ArithmeticEnv(), scripted([turn1, turn2]),
                                 mt.TurnRenderer(tok, use_chat_template=False))
    assert tok.convert_ids_to_tokens(plain.input_ids.tolist()) == [
        "<s>", "compute", "2", "*", "3", "<calc>", "2", "*", "3", "</calc>", "<result>", "6", "</result>",
        "<answer>", "6", "</answer>", "</s>"]
    assert plain.action_mask.int().tolist() == [0] * 5 + [1] * 5 + [0] * 3 + [1] * 4
    # with the chat template, the environment closes the model's unfinished turn with EOS: its token, mask 0
    chat = mt.multiturn_rollout("compute 2 * 3", mt.ArithmeticEnv(), scripted([turn1, turn2]), mt.TurnRenderer(tok))
    tokens = tok.convert_ids_to_tokens(chat.input_ids.tolist())
    assert tokens[7:19] == ["<calc>", "2", "*", "3", "</calc>", "</s>", "<|tool|>", "<result>", "6", "</result>",
                            "<|assistant|>", "<answer>"]
    assert chat.action_mask.int().tolist()[7:19] == [1] * 5 + [0] * 6 + [1]


def test_caps(tok):
    call = ids(tok, "<calc> 1 + 1 </calc>") + [tok.eos_token_id]
    r = mt.multiturn_rollout("compute 1 + 1", mt.ArithmeticEnv(max_tool_calls=9), scripted([call]),
                             mt.TurnRenderer(tok), max_turns=1)
    assert (r.turns, r.done, r.stop, r.reward) == (1, False, "max_turns", 0.0)
    assert r.input_ids.numel() == 7 + len(call) and r.action_mask[7:].all()  # no trailing environment turn
    # 7 prompt tokens, then 6 model + 5 tool tokens per turn: 13, 18, 24, 29
    budgets: list[tuple[int, int]] = []
    r = mt.multiturn_rollout("compute 1 + 1", mt.ArithmeticEnv(max_tool_calls=99), scripted([call], budgets),
                             mt.TurnRenderer(tok), max_turns=50, max_total_tokens=29, max_new_tokens=8)
    assert (r.stop, r.input_ids.numel(), r.turns, r.done) == ("max_total_tokens", 24, 2, False)  # no room after
    # one more token of room: the third turn gets a budget of 1 and is cut to "<calc>", a (wrong) final answer
    budgets.clear()
    r = mt.multiturn_rollout("compute 1 + 1", mt.ArithmeticEnv(max_tool_calls=99), scripted([call], budgets),
                             mt.TurnRenderer(tok), max_turns=50, max_total_tokens=30, max_new_tokens=8)
    assert budgets == [(7, 8), (18, 8), (29, 1)]
    assert (r.stop, r.input_ids.numel(), r.turns, r.reward) == ("done", 30, 3, 0.0)
    # a generator that ignores its budget is cut to it
    r = mt.multiturn_rollout("compute 1 + 1", mt.ArithmeticEnv(), scripted([[7] * 50]), mt.TurnRenderer(tok),
                             max_turns=1, max_total_tokens=12, max_new_tokens=40)
    assert r.input_ids.numel() == 12 and int(r.action_mask.sum()) == 5
    with pytest.raises(ValueError, match="max_total_tokens=7"):
        mt.multiturn_rollout("compute 1 + 1", mt.ArithmeticEnv(), scripted([call]), mt.TurnRenderer(tok),
                             max_total_tokens=7)
    with pytest.raises(ValueError, match="max_turns"):
        mt.multiturn_rollout("compute 1 + 1", mt.ArithmeticEnv(), scripted([call]), mt.TurnRenderer(tok), max_turns=0)


def test_rollout_is_reproducible_from_the_seed(tok, model):
    generate = mt.sampling_generate(model, tok.eos_token_id, temperature=1.0)
    renderer = mt.TurnRenderer(tok)
    prompts = mt.arithmetic_prompts(3, seed=0)
    caps = {"max_turns": 3, "max_total_tokens": 40, "max_new_tokens": 6}
    a = mt.multiturn_rollouts(prompts, mt.ArithmeticEnv, generate, renderer, seed=4, **caps)
    b = mt.multiturn_rollouts(prompts, mt.ArithmeticEnv, generate, renderer, seed=4, **caps)
    c = mt.multiturn_rollouts(prompts, mt.ArithmeticEnv, generate, renderer, seed=5, **caps)
    assert [r.input_ids.tolist() for r in a] == [r.input_ids.tolist() for r in b]
    assert [r.action_mask.tolist() for r in a] == [r.action_mask.tolist() for r in b]
    assert [r.input_ids.tolist() for r in a] != [r.input_ids.tolist() for r in c]
    # one prompt's episode does not depend on the others of its batch
    alone = mt.multiturn_rollout(prompts[2], mt.ArithmeticEnv(), generate, renderer, seed=mt.rollout_seed(4, 2), **caps)
    assert alone.input_ids.tolist() == a[2].input_ids.tolist()


# --------------------------------------------------------------------------------------------------
# no gradient reaches the environment's tokens
# --------------------------------------------------------------------------------------------------


def test_environment_tokens_get_no_gradient(tok, model):
    eos = tok.eos_token_id
    r1 = mt.multiturn_rollout("compute 2 + 3", mt.ArithmeticEnv(), scripted([
        ids(tok, "<calc> 2 + 3 </calc>") + [eos], ids(tok, "<answer> 5 </answer>") + [eos]]), mt.TurnRenderer(tok))
    r2 = mt.multiturn_rollout("compute 12 - 3 + 1", mt.ArithmeticEnv(),
                              scripted([ids(tok, "<answer> 8 </answer>") + [eos]]), mt.TurnRenderer(tok))
    batch = mt.to_experience_layout([r1, r2], tok.pad_token_id)
    seq, attention, C = batch["sequences"], batch["attention_mask"], batch["context_length"]
    action = batch["action_mask"]
    assert C == 9 and batch["score"].tolist() == [1.0, 0.0]  # r2's prompt is 2 tokens longer: r1 is left padded
    assert attention[0].tolist()[:2] == [0, 0] and seq[0, :2].tolist() == [tok.pad_token_id] * 2
    assert action[0].int().tolist() == r1.action_mask[7:].int().tolist() and int(action[0].sum()) == 10
    assert action[1].int().tolist()[:4] == [1] * 4 and not action[1, 4:].any()  # "<answer> 8 </answer> </s>"

    model.zero_grad()
    out = model(input_ids=seq, attention_mask=attention, position_ids=position_ids_from_mask(attention))
    logits = out.logits
    logits.retain_grad()
    logp = ppo.response_logprobs(logits, seq, C)
    advantages = torch.tensor([[1.0], [-1.0]]).expand_as(logp)  # non-zero everywhere, environment tokens included
    loss, _ = losses.policy_loss("ppo", losses.PolicyLossInputs(logp, logp.detach(), advantages, action),
                                 GRPOSettings())
    loss.backward()
    per_position = logits.grad[:, C - 1:-1].abs().sum(-1)  # position C-1+t scores response token t
    assert ((per_position > 0) == action).all()  # gradient exactly on the model's tokens
    assert float(per_position[~action].abs().sum()) == 0.0
    assert float(logits.grad[:, :C - 1].abs().sum()) == 0.0
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_chatml_style_template_closes_every_turn_with_eos(tok):
    import copy

    chatml = copy.deepcopy(tok)
    chatml.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
                            "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    eos = tok.eos_token_id
    turns = [ids(tok, "<calc> 4 * 5 </calc>") + [eos], ids(tok, "<answer> 20 </answer>") + [eos]]
    r = mt.multiturn_rollout("compute 4 * 5", mt.ArithmeticEnv(), scripted(turns), mt.TurnRenderer(chatml))
    assert tok.convert_ids_to_tokens(r.input_ids.tolist()) == [
        "<|user|>", "compute", "4", "*", "5", "</s>", "<|assistant|>",
        "<calc>", "4", "*", "5", "</calc>", "</s>",  # the model's EOS closes its turn: not repeated
        "<|tool|>", "<result>", "20", "</result>", "</s>", "<|assistant|>",  # the tool turn, closed by the template
        "<answer>", "20", "</answer>", "</s>"]
    assert r.action_mask.int().tolist() == [0] * 7 + [1] * 6 + [0] * 6 + [1] * 4
    assert r.reward == 1.0

"""Tokenizers per role: detect that two roles tokenize differently, and re-encode the actor's sequences
for a scoring role (reward model, critic) that has its own tokenizer.

The actor samples token ids of *its* vocabulary; a reward model trained with another tokenizer would read
them as ids of its own and score nonsense, silently. So the actor's sequences are decoded to text and
encoded again with the scoring role's tokenizer, in exactly the layout that role was trained on (the
step-2 collators': prompt with its special tokens or chat template, response, EOS when the actor emitted
one), as OpenRLHF does for remote reward models. Equal vocabularies need no re-encoding.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .data import _Encoder, _pad, is_conversation
from .runs import role_tokenizer

logger = logging.getLogger(__name__)

__all__ = ["Retokenizer", "check_scoring_tokenizers", "needs_reencoding", "retokenizers", "vocabularies_match"]

_SPECIALS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


def vocabularies_match(a: Any, b: Any) -> bool:
    """True when two tokenizers map the same strings to the same ids (added tokens included) and have the
    same special-token ids; their names do not matter."""
    if a is b:
        return True
    if len(a) != len(b) or any(getattr(a, k, None) != getattr(b, k, None) for k in _SPECIALS):
        return False
    return a.get_vocab() == b.get_vocab()


def needs_reencoding(source: Any, target: Any, conversational: bool = False) -> bool:
    """Whether ``target``'s role must get re-encoded sequences: the vocabularies differ, or (for
    conversational data) the chat templates do."""
    if not vocabularies_match(source, target):
        return True
    return conversational and getattr(source, "chat_template", None) != getattr(target, "chat_template", None)


def _visible_chars(text: str) -> int:
    return len("".join(text.split()))


class Retokenizer:
    """Actor (``source``) sequences -> ids of a scoring role's tokenizer (``target``), ready for scoring.

    Args:
        source: the actor's tokenizer.
        target: the reward model's / critic's tokenizer.
        max_prompt_len, max_response_len: the target role's limits (as its step-2 collator had them).
        conversational: the prompts are conversations (``prompt_messages`` must be passed then); with
            equal vocabularies but different chat templates it still re-encodes.
    """

    def __init__(self, source: Any, target: Any, max_prompt_len: int, max_response_len: int,
                 conversational: bool = False) -> None:
        self.source = source
        self.target = target
        self.encoder = _Encoder(target, max_prompt_len, max_response_len)
        self.conversational = conversational
        self.needed = needs_reencoding(source, target, conversational)
        self.source_eos = source.eos_token_id
        self.source_pad = source.pad_token_id if source.pad_token_id is not None else source.eos_token_id

    def response_mask(self, response_ids: torch.Tensor) -> torch.Tensor:
        """Generated tokens up to and including the first EOS (all of them when there is none)."""
        is_eos = response_ids == self.source_eos
        after = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
        return (~after).long()

    def __call__(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        response_ids: torch.Tensor,
        response_mask: torch.Tensor | None = None,
        prompts: Sequence[str] | None = None,
        prompt_messages: Sequence[Sequence[Mapping[str, Any]]] | None = None,
        align: bool = False,
    ) -> dict[str, Any]:
        """Sequences for the target role.

        Args:
            prompt_ids, prompt_mask: ``[B, C]``, left padded (the actor's prompt batch).
            response_ids: ``[B, T]`` generated ids.
            response_mask: ``[B, T]`` valid response tokens (default: up to and including the first EOS).
            prompts: the prompt strings (default: decoded from ``prompt_ids``; pass the originals so a
                left-truncated prompt is whole again).
            prompt_messages: the conversations of conversational prompts (``batch["prompt_messages"]``).
            align: also return ``value_index`` ``[B, T]``: for each actor response token, the position in
                the new sequence of the target token that ends the same text; and ``state_index`` ``[B, T]``:
                for each actor action, the position whose value is that of the state before it (the position
                of the text before the action: ``value_index`` of the previous token, the last prompt token
                for the first), which is where a critic's value ``V(s_t)`` of action ``t`` is read, as
                ``ppo.response_values`` reads it from the actor's own sequences.

        Returns:
            ``input_ids``/``attention_mask`` ``[B, L]`` (right padded; score at the last real token),
            ``reencoded`` (False: the actor's own sequences, prompt left padded, masked response after),
            ``responses`` (decoded texts, when re-encoded), ``value_index`` and ``state_index`` (with ``align``).
        """
        if response_mask is None:
            response_mask = self.response_mask(response_ids)
        response_mask = response_mask.long()
        if self.conversational and prompt_messages is None:
            raise ValueError("conversational prompts: pass prompt_messages (the PromptCollator's batch has them)")
        if not self.needed:
            ids = torch.cat([prompt_ids, torch.where(response_mask.bool(), response_ids,
                                                     torch.full_like(response_ids, self.source_pad))], dim=1)
            out: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.cat([prompt_mask, response_mask], 1),
                                   "reencoded": False}
            if align:
                c = prompt_ids.shape[1]
                out["value_index"] = torch.arange(c, c + response_ids.shape[1]).expand_as(response_ids).clone()
                out["state_index"] = out["value_index"] - 1
            return out
        rows, texts, index, state = [], [], [], []
        for b in range(response_ids.shape[0]):
            valid = response_ids[b][response_mask[b].bool()].tolist()
            ended = bool(valid) and valid[-1] == self.source_eos
            body = valid[:-1] if ended else valid
            text = self.source.decode(body, skip_special_tokens=True)
            if prompt_messages is not None and is_conversation(prompt_messages[b]):
                p, r = self.encoder.conversation_ids(prompt_messages[b], text, eos=ended)
            else:
                prompt = prompts[b] if prompts is not None else self.source.decode(
                    prompt_ids[b][prompt_mask[b].bool()].tolist(), skip_special_tokens=True)
                p, r = self.encoder.prompt_ids(prompt), self.encoder.response_ids(text, eos=ended)
            rows.append(p + r)
            texts.append(text)
            if align:
                index.append(self._align(body, ended, len(p), r, response_ids.shape[1]))
                state.append([max(len(p) - 1, 0), *index[-1][:-1]])
        out = {"input_ids": _pad(rows, self.encoder.pad_id, left=False),
               "attention_mask": _pad([[1] * len(r) for r in rows], 0, left=False),
               "reencoded": True, "responses": texts}
        if align:
            out["value_index"] = torch.tensor(index, dtype=torch.long)
            out["state_index"] = torch.tensor(state, dtype=torch.long)
        return out

    def _align(self, body: list[int], ended: bool, start: int, target_response: list[int], width: int) -> list[int]:
        """For each actor response position, the target position whose decoded text first covers as many
        visible characters as the actor's tokens so far (padding positions repeat the last one)."""
        if not target_response:
            return [max(start - 1, 0)] * width
        target_body = target_response[:-1] if ended else target_response
        covered = [_visible_chars(self.target.decode(target_body[: j + 1], skip_special_tokens=True))
                   for j in range(len(target_body))]
        last = start + len(target_response) - 1
        out = []
        for t in range(len(body)):
            need = _visible_chars(self.source.decode(body[: t + 1], skip_special_tokens=True))
            j = next((j for j, c in enumerate(covered) if c >= need), len(covered) - 1)
            out.append(start + max(j, 0) if covered else last)
        if ended:
            out.append(last)  # the actor's EOS -> the target's EOS
        return (out + [last] * width)[:width]


def position_budget(path: str) -> int:
    """Tokens a re-encoded row may have per part (prompt, response): half the model's positions."""
    from transformers import AutoConfig

    try:
        positions = getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None)
    except (OSError, ValueError):
        positions = None
    return max(int(positions or 1024) // 2, 8)


def retokenizers(actor_tokenizer: Any, roles: list[tuple[str, str, str]], conversational: bool,
                 tokenizers: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Retokenizer | None]]:
    """Each scoring role's tokenizer and, when it tokenizes differently from the actor (vocabularies
    compared, and chat templates for conversational prompts), the :class:`Retokenizer` that re-encodes the
    actor's rows for it; ``None`` = the actor's ids are used as they are.

    Args:
        roles: ``(role, model folder, tokenizer key's value)``; "" = the folder's own tokenizer (the actor's
            when the folder has none).
        tokenizers: tokenizers already loaded, by role (reused, e.g. the critic's = the reward model's).

    Returns:
        ``({role: tokenizer}, {role: Retokenizer or None})``.
    """
    toks, retoks = dict(tokenizers or {}), {}
    for role, path, given in roles:
        tok = toks.get(role) or role_tokenizer(given, path, actor_tokenizer, what=f"role {role!r}")
        toks[role] = tok
        if needs_reencoding(actor_tokenizer, tok, conversational):
            budget = position_budget(path)
            retoks[role] = Retokenizer(actor_tokenizer, tok, budget, budget, conversational=conversational)
            logger.info("%s: its tokenizer (%s, %d tokens) differs from the actor's (%s, %d tokens): the actor's "
                        "prompts and answers are decoded and re-encoded for it", role,
                        getattr(tok, "name_or_path", "?"), len(tok), getattr(actor_tokenizer, "name_or_path", "?"),
                        len(actor_tokenizer))
        else:
            retoks[role] = None
    return toks, retoks


def check_scoring_tokenizers(actor_tokenizer: Any, roles: Sequence[tuple[str, str, str, str]],
                             conversational: bool) -> None:
    """Each scoring role's tokenizer loads and fits its model and, when it must re-encode conversational
    prompts, has a chat template. ``roles``: ``(role, model folder, tokenizer value, tokenizer key)``; a role
    without a folder is skipped.

    Raises:
        OSError, ValueError: naming the role, its folder or tokenizer key, and the fix.
    """
    from ..checks import check_vocab_fits
    from .data import check_chat_template

    for role, path, given, key in roles:
        if not path:
            continue
        tok = role_tokenizer(given, path, actor_tokenizer, what=f"role {role!r}")
        check_vocab_fits(tok, path, key=f"the {role} model ({path})", tokenizer_key=key if given else None)
        if actor_tokenizer is not None and needs_reencoding(actor_tokenizer, tok, conversational):
            check_chat_template(tok, conversational, key="data.source", tokenizer_key=key)

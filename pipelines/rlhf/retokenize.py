"""Tokenizers per role: whether two roles tokenize differently, and the actor's sequences re-encoded for a scoring
role (reward model, critic) with its own tokenizer: decoded to text and encoded again in the layout that role was
trained on (the step-2 collators': prompt with its special tokens or chat template, response, EOS when the actor
emitted one), as OpenRLHF does for remote reward models; equal vocabularies need none."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..checks import role_tokenizer
from .data import _Encoder, _pad, is_conversation

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
    """The actor's (``source`` tokenizer) sequences as ids of a scoring role's ``target`` tokenizer, ready for
    scoring, within that role's prompt and response limits; ``conversational``: the prompts are conversations (pass
    ``prompt_messages``; equal vocabularies with different chat templates still re-encode)."""

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
        """Sequences for the target role from the actor's left-padded prompts ``[B, C]`` and generated ids ``[B, T]``
        (``response_mask``: the valid ones, default up to the first EOS; ``prompts``: the original prompt strings, so a
        left-truncated prompt is whole again; ``prompt_messages``: the conversations): ``input_ids`` /
        ``attention_mask`` ``[B, L]`` (right padded; the score is read at the last real token), ``reencoded`` (False:
        the actor's own ids), ``responses`` (decoded texts, when re-encoded) and with ``align``: ``value_index`` ``[B,
        T]`` (for each actor token, the target position ending the same text) and ``state_index`` (where a critic's
        value of the state before each action is read: the previous token's position, the last prompt token for the
        first, as ``ppo.response_values`` reads the actor's own sequences)."""
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
    """``({role: tokenizer}, {role: Retokenizer or None})`` of each scoring role ``(role, model folder, its tokenizer
    key's value: "" = the folder's own, else the actor's)``: a Retokenizer where it tokenizes differently from the
    actor (vocabularies, and chat templates for conversational prompts), None where the actor's ids are used as they
    are; ``tokenizers``: those already loaded, by role."""
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
    """Each scoring role's tokenizer loads, fits its model and, where it re-encodes conversations, has a chat
    template; ``roles``: ``(role, model folder, tokenizer value, tokenizer key)``, a role without a folder skipped.
    OSError / ValueError naming the role, its folder or key and the fix."""
    from ..checks import check_vocab_fits
    from .data import check_chat_template

    for role, path, given, key in roles:
        if not path:
            continue
        tok = role_tokenizer(given, path, actor_tokenizer, what=f"role {role!r}")
        check_vocab_fits(tok, path, key=f"the {role} model ({path})", tokenizer_key=key if given else None)
        if actor_tokenizer is not None and needs_reencoding(actor_tokenizer, tok, conversational):
            check_chat_template(tok, conversational, key="data.source", tokenizer_key=key)

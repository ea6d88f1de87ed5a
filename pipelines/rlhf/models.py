"""Scalar-head models for RLHF: the reward model (step 2) and the critic (step 3).

A :class:`ScalarHeadModel` is a transformer body without its LM head (``AutoModel``, e.g.
``OPTModel``) plus a bias-free ``Linear(hidden, 1)``. It saves in Hugging Face's sequence-classification
form (``*ForSequenceClassification``, ``num_labels=1``: the body's weights under the class's base-model
prefix plus ``score.weight``), so ``AutoModelForSequenceClassification.from_pretrained`` loads it with
no missing or unexpected weights and gives the same scores. It loads from

* such a folder, ours or any other (e.g. a reward model trained with TRL): body + its ``score`` head;
* the older value-head form: a base-model folder plus ``value_head.safetensors``;
* any causal-LM folder: the body, with a fresh head.

The same folder serves as a reward model and as a critic (DeepSpeed-Chat initialises the critic from
the reward model).

Score position: the value at the last real token (the last 1 of the attention mask).
``*ForSequenceClassification`` takes the rightmost token that is not ``config.pad_token_id``; the two
agree whenever the pad id marks only padding, i.e. the tokenizer's pad token differs from its EOS (with
pad = EOS the Hugging Face class scores the token before a final EOS; saving warns).

ZeRO-3: when the body is loaded under ``HfDeepSpeedConfig``/``deepspeed.zero.Init`` and the head is
created inside an active ``deepspeed.zero.Init``, the head weight is partitioned (shape ``[0]`` on each
rank); initialising or loading it then happens under
``deepspeed.zero.GatheredParameters(weight, modifier_rank=0)`` so rank 0's values are what every
shard ends up with.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

try:
    # Import torch._dynamo now: transformers imports it lazily with the model class, and when that first
    # import happens inside deepspeed.zero.Init (which patches Tensor.__new__) dynamo's polyfill loader
    # raises "Signature mismatch ... tensor_pynew" (torch 2.13 / DeepSpeed 0.19.8).
    import torch._dynamo  # noqa: F401
except ImportError:  # pragma: no cover - builds without dynamo
    pass

logger = logging.getLogger(__name__)

__all__ = ["VALUE_HEAD_FILE", "ScalarHeadModel", "is_sequence_classification", "last_token_index", "pairwise_loss"]

VALUE_HEAD_FILE = "value_head.safetensors"


def _hidden_size(config: Any) -> int:
    """Width of the body's last hidden state (OPT projects it to ``word_embed_proj_dim``)."""
    for name in ("word_embed_proj_dim", "hidden_size", "n_embd", "d_model"):
        value = getattr(config, name, None)
        if value:
            return int(value)
    raise ValueError(f"cannot infer the hidden size from {type(config).__name__}")


def is_sequence_classification(config: Any) -> bool:
    """A config saved by a ``*ForSequenceClassification`` model (its ``architectures``)."""
    return any(str(a).endswith("ForSequenceClassification") for a in (getattr(config, "architectures", None) or ()))


def _sequence_classification_class(config: Any) -> type:
    from transformers import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING

    try:
        return MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING[type(config)]
    except KeyError as err:
        raise ValueError(f"transformers has no *ForSequenceClassification class for {type(config).__name__}; this "
                         f"model cannot be a Hugging Face reward model") from err


def _is_partitioned(param: torch.Tensor) -> bool:
    return hasattr(param, "ds_id")


def _gathered(params: list[torch.Tensor], modifier_rank: int | None):
    """``GatheredParameters`` over the ZeRO-3 partitioned ``params``; a no-op context otherwise."""
    partitioned = [p for p in params if _is_partitioned(p)]
    if not partitioned:
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=modifier_rank)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last real (mask = 1) token in each row, ``[B, T] -> [B]`` (long).

    Correct for right padding (the usual case for scoring) and for left padding; a row with no real
    token gets index 0.
    """
    mask = attention_mask.bool()
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask, positions, torch.zeros_like(positions)).max(dim=-1).values


class ScalarHeadModel(nn.Module):
    """LM body + ``nn.Linear(hidden, 1, bias=False)``: one scalar per position.

    Args:
        body: a base transformer returning ``last_hidden_state`` (e.g. ``OPTModel``).
        value_head: optional ready head; by default a new one is created (not initialised here, see
            :meth:`init_head`).
    """

    def __init__(self, body: nn.Module, value_head: nn.Linear | None = None) -> None:
        super().__init__()
        self.body = body
        self.config = body.config
        self.value_head = value_head if value_head is not None else nn.Linear(
            _hidden_size(body.config), 1, bias=False
        )

    # ---------------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        use_cache: bool = False,
    ) -> torch.Tensor:
        """Per-position scalar values.

        Args:
            input_ids: ``[B, T]``.
            attention_mask: ``[B, T]`` (1 = real token).
            position_ids: ``[B, T]``, optional; pass them for left-padded rows of models that do not derive
                positions from the mask (OPT does, Llama does not), and restarting per sequence for packed rows.
            use_cache: accepted as causal LMs take it; the body never caches (a cache would hide packed sequences).

        Returns:
            ``[B, T]`` values in the head's dtype.
        """
        kwargs = {} if position_ids is None else {"position_ids": position_ids}
        out = self.body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1)

    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Sequence score: the value at the last real token (right padding assumed, left works too).

        Args:
            input_ids: ``[B, T]``.
            attention_mask: ``[B, T]``.

        Returns:
            ``[B]`` scores.
        """
        values = self.forward(input_ids, attention_mask)
        index = last_token_index(attention_mask)
        return values.gather(1, index.unsqueeze(1)).squeeze(1)

    # ---------------------------------------------------------------------------------------------
    def init_head(self, std: float | None = None, seed: int | None = None) -> None:
        """Normal(0, std) init of the head, std = ``1 / (hidden + 1)`` by default (OpenRLHF).

        Under ZeRO-3 the weight is gathered with ``modifier_rank=0``; rank 0's draw is broadcast.
        """
        weight = self.value_head.weight
        with _gathered([weight], modifier_rank=0), torch.no_grad():
            hidden = weight.shape[-1]
            std = 1.0 / (hidden + 1) if std is None else std
            generator = None
            if seed is not None:
                generator = torch.Generator(device=weight.device)
                generator.manual_seed(seed)
            weight.copy_(torch.randn(weight.shape, generator=generator, device=weight.device) * std)

    def load_head(self, path: str | Path) -> None:
        """Load ``value_head.safetensors`` (key ``weight``) into the head, gathered under ZeRO-3."""
        from safetensors.torch import load_file

        state = load_file(str(path))
        weight = self.value_head.weight
        with _gathered([weight], modifier_rank=0), torch.no_grad():
            if tuple(state["weight"].shape) != tuple(weight.shape):
                raise ValueError(
                    f"value head in {path} has shape {tuple(state['weight'].shape)}, the model expects "
                    f"{tuple(weight.shape)}"
                )
            weight.copy_(state["weight"].to(weight.dtype))

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        zero3: bool = False,
        dtype: torch.dtype | None = None,
        head_seed: int | None = None,
        **body_kwargs: Any,
    ) -> ScalarHeadModel:
        """Body via ``AutoModel.from_pretrained(path)``; head from ``value_head.safetensors`` or fresh.

        Args:
            path: a scalar-head folder (saved by :meth:`save_pretrained`) or any causal-LM folder.
            zero3: the caller is building under ZeRO-3: a transformers ``HfDeepSpeedConfig`` (stage 3)
                must be alive (checked; ``RuntimeError`` otherwise), and the call may also be wrapped
                in ``deepspeed.zero.Init`` so the head is created partitioned. A partitioned head is
                initialised/loaded under ``GatheredParameters(modifier_rank=0)``; an unpartitioned one
                (no ``zero.Init`` around the call) is set normally and partitioned by the engine.
            dtype: cast body and head to this dtype (the engine dtype, e.g. ``torch.bfloat16``).
            head_seed: seed for a fresh head's init (identical on every rank).
            body_kwargs: passed to ``AutoModel.from_pretrained``.
        """
        from transformers import AutoConfig, AutoModel
        from transformers.integrations import is_deepspeed_zero3_enabled

        if zero3 and not is_deepspeed_zero3_enabled():
            # Without it transformers neither partitions nor loads the body the ZeRO-3 way; inside an
            # explicit zero.Init it even fails in its weight init (IndexError on the padding row).
            raise RuntimeError(
                "ScalarHeadModel.from_pretrained(zero3=True) needs a live transformers HfDeepSpeedConfig "
                "with ZeRO stage 3 (keep a reference to it while loading)"
            )
        if dtype is not None:
            body_kwargs.setdefault("dtype", dtype)
        head_file = Path(path) / VALUE_HEAD_FILE
        config = body_kwargs.get("config")
        if config is None and not head_file.is_file():
            config = AutoConfig.from_pretrained(str(path))
        if not head_file.is_file() and is_sequence_classification(config):
            model = cls._from_sequence_classification(path, config, body_kwargs)
        else:
            body = AutoModel.from_pretrained(str(path), **body_kwargs)
            model = cls(body)
            if zero3 and not _is_partitioned(model.value_head.weight):
                logger.info(
                    "zero3=True but the value head is not partitioned (created outside deepspeed.zero.Init); "
                    "the engine will partition it"
                )
            if head_file.is_file():
                model.load_head(head_file)
            else:
                logger.info("no %s and no sequence-classification head in %s: initialising a new value head",
                            VALUE_HEAD_FILE, path)
                model.init_head(seed=head_seed)
        if dtype is not None:
            model.value_head.to(dtype)
        return model

    def apply_lora(self, lora: Any, seed: int = 0) -> ScalarHeadModel:
        """LoRA adapters in the body (peft), the value head trainable: a frozen random head could not
        learn values. Called by ``multiengine.engines.apply_lora`` for this composite model."""
        from multiengine.engines import zero_init_paused
        from peft import get_peft_model

        self.body.requires_grad_(False)
        with zero_init_paused(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.body = get_peft_model(self.body, lora.peft_config())
        self.value_head.requires_grad_(True)
        return self

    @classmethod
    def _from_sequence_classification(cls, path: str | Path, config: Any, kwargs: dict[str, Any]) -> ScalarHeadModel:
        """Body and ``score`` head of a ``*ForSequenceClassification`` checkpoint; transformers loads both
        (partitioned and gathered-on-load under a live ZeRO-3 ``HfDeepSpeedConfig``)."""
        from transformers import AutoModelForSequenceClassification

        if getattr(config, "num_labels", 1) != 1:
            raise ValueError(f"{path} is a sequence classifier with num_labels={config.num_labels}; a reward model or "
                             f"critic has one output (num_labels=1, e.g. TRL's RewardTrainer)")
        full = AutoModelForSequenceClassification.from_pretrained(str(path), **kwargs)
        head = getattr(full, "score", None)
        body = full.base_model
        if not isinstance(head, nn.Linear) or body is full:
            raise ValueError(f"{path} ({type(full).__name__}) has no last-token `score` head on a base model (e.g. a "
                             f"pooled classifier); only decoder-style sequence classifiers can be reward models")
        if head.bias is not None:
            raise ValueError(f"the score head of {path} has a bias; ScalarHeadModel's head is bias-free "
                             f"(as every decoder *ForSequenceClassification in transformers)")
        logger.info("loaded %s as a scalar-head model (body + its score head)", type(full).__name__)
        return cls(body, value_head=head)

    def save_pretrained(self, out_dir: str | Path, state_dict: dict[str, torch.Tensor] | None = None,
                        pad_token_id: int | None = None) -> Path:
        """Write a ``*ForSequenceClassification`` folder (``num_labels=1``): config, body weights under the
        class's base-model prefix and ``score.weight``, checked to be exactly the class's weights.

        Writes this rank's tensors (no collective): under ZeRO-3 call it inside a gather of every parameter,
        as ``multiengine.engines.save_role`` does.

        Args:
            state_dict: keys ``body.*`` and ``value_head.weight`` in place of the module's own tensors (e.g.
                with LoRA merged, as the export passes them).
            pad_token_id: the tokenizer's pad id, written to the config (the Hugging Face class scores the
                last token that is not this id; ``None`` keeps the config's).

        Returns ``out_dir``.
        """
        import copy

        from huggingface_hub import save_torch_state_dict

        out = Path(out_dir)
        if state_dict is None:
            state_dict = {k: v.detach().cpu().clone() for k, v in self.state_dict().items()}
        body_state = {k[len("body."):]: v.detach().cpu().contiguous() for k, v in state_dict.items()
                      if k.startswith("body.")}
        head = state_dict["value_head.weight"].detach().cpu().contiguous().clone()
        body = self.body.get_base_model() if hasattr(self.body, "get_base_model") else self.body
        config = copy.deepcopy(body.config)
        seq_cls = _sequence_classification_class(config)
        config.num_labels = 1
        config.architectures = [seq_cls.__name__]
        if pad_token_id is not None:
            config.pad_token_id = int(pad_token_id)
        if config.pad_token_id is None:
            logger.warning("saving a reward model without config.pad_token_id: AutoModelForSequenceClassification "
                           "then scores only batches of one (pass the tokenizer's pad id)")
        elif config.pad_token_id == getattr(config, "eos_token_id", None):
            logger.warning("pad id == eos id (%d): AutoModelForSequenceClassification scores the token before a "
                           "final EOS, ScalarHeadModel the EOS itself; use a tokenizer with its own pad token",
                           config.pad_token_id)
        prefix = seq_cls.base_model_prefix
        state = {f"{prefix}.{k}": v for k, v in body_state.items()}
        state["score.weight"] = head
        with torch.device("meta"):
            expected = set(seq_cls(config).state_dict())
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            raise RuntimeError(f"{seq_cls.__name__} would load this model with missing {missing[:5]} / "
                               f"unexpected {unexpected[:5]} weights (LoRA bodies must be merged first)")
        out.mkdir(parents=True, exist_ok=True)
        (out / VALUE_HEAD_FILE).unlink(missing_ok=True)  # an older export's head must not shadow this one
        config.save_pretrained(str(out))
        save_torch_state_dict(state, str(out))
        return out


def pairwise_loss(
    chosen_scores: torch.Tensor, rejected_scores: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bradley-Terry reward loss ``-logsigmoid(c - r).mean()`` and the pair accuracy ``mean(c > r)``.

    Args:
        chosen_scores: ``[B]``.
        rejected_scores: ``[B]``.

    Returns:
        ``(loss, accuracy)`` scalars; accuracy is detached.
    """
    diff = chosen_scores.float() - rejected_scores.float()
    loss = -F.logsigmoid(diff).mean()
    accuracy = (diff > 0).float().mean().detach()
    return loss, accuracy

"""A *ForSequenceClassification checkpoint (as TRL saves reward models) as the reward (frozen) and critic
(trainable) roles at ZeRO-3: partitioned body and score head, the Hugging Face class's scores, a training step
of the critic, and the reward exported (gathered) in sequence-classification form."""

import os

import torch
import torch.distributed as dist
from common import dump, out_dir
from multiengine.engines import EngineRegistry, OptimSpec, Placement, frozen_role, save_role, trainable_role
from multiengine.pipelines.rlhf.models import last_token_index
from multiengine.pipelines.rlhf.roles import scalar_model

PAD = 0
registry = EngineRegistry()
path = os.path.join(out_dir(), "trl_reward")
if registry.is_main:
    from transformers import OPTConfig, OPTForSequenceClassification

    torch.manual_seed(0)
    config = OPTConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
                       max_position_embeddings=64, word_embed_proj_dim=64, dropout=0.0, num_labels=1,
                       pad_token_id=PAD)
    model = OPTForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)
    model.save_pretrained(path)
dist.barrier()

seqs = [[1, 10, 11, 12, 2], [1, 20, 21, 2], [1, 30, 2], [1, 40, 41, 42, 43, 2]]
width = max(map(len, seqs))
ids = torch.tensor([s + [PAD] * (width - len(s)) for s in seqs])
mask = (ids != PAD).long()

from transformers import AutoModelForSequenceClassification  # noqa: E402  (after the build scope is gone)

reference = AutoModelForSequenceClassification.from_pretrained(path).eval()
with torch.no_grad():
    expected = reference(input_ids=ids, attention_mask=mask).logits.squeeze(-1)


def value_loss(values):
    return ((values - 1.0) ** 2 * mask).sum() / mask.sum()


# the same critic steps on one process without DeepSpeed (same batch on both ranks: the mean gradient is it)
from multiengine.pipelines.rlhf.models import ScalarHeadModel  # noqa: E402

plain = ScalarHeadModel.from_pretrained(path)
opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
plain_losses = []
for _ in range(3):
    loss = value_loss(plain(ids, mask))
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
    opt.step()
    plain_losses.append(loss.item())

registry.add(frozen_role("reward", scalar_model(path, zero3=True), Placement(stage=3, dtype="fp32")))
registry.add(trainable_role("critic", scalar_model(path, zero3=True), Placement(stage=3, dtype="fp32"),
                            OptimSpec(lr=1e-4, betas=(0.9, 0.95)), micro_batch_size=len(seqs)))
registry.build()

result = {}
for name in ("reward", "critic"):
    module = registry[name].module
    head = module.value_head.weight
    result[name] = {"head_partitioned": hasattr(head, "ds_id"), "head_numel": int(head.ds_numel),
                    "head_local": int(head.ds_tensor.numel()),
                    "body_local": sum(p.ds_tensor.numel() for p in module.body.parameters()),
                    "body_total": sum(p.ds_numel for p in module.body.parameters())}
    with torch.no_grad():
        values = registry[name](ids, mask)
        scores = values.gather(1, last_token_index(mask).unsqueeze(1)).squeeze(1)
    result[name]["max_score_diff"] = (scores.float() - expected).abs().max().item()

# one critic step toward fixed targets: the HF-form critic trains
critic = registry["critic"]
losses = []
for _ in range(3):
    loss = value_loss(critic(ids, mask))
    critic.backward(loss)
    critic.step()
    losses.append(loss.item())
result["critic_losses"] = losses
result["plain_losses"] = plain_losses

export = os.path.join(out_dir(), "export_reward")
save_role(registry, "reward", export)
result["export"] = export
result["ids"], result["mask"], result["expected"] = ids.tolist(), mask.tolist(), expected.tolist()
dump(result)
from common import finish  # noqa: E402

finish()  # leave together, skip the interpreter's teardown

"""Tiny, randomly initialised diffusers folders of every family (SD, SDXL, SD3, FLUX) built offline, with real
tokenizers trained on the shapes captions, and the pre-training of a tiny vae so generations decode to images."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .data import shapes_captions

logger = logging.getLogger(__name__)

__all__ = ["T5_SPECIAL_TOKENS", "build_clip_tokenizer", "build_t5_tokenizer", "build_tiny",
           "build_tiny_clip_text_encoder", "build_tiny_flux", "build_tiny_sd", "build_tiny_sd3", "build_tiny_sdxl",
           "build_tiny_t5_encoder", "build_tiny_vae", "pretrain_tiny_vae", "vae_pretrain_images"]

BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"
# CLIP's pre-tokenizer regex (as in transformers' CLIPTokenizer): special tokens, contractions, letter runs, digits,
# punctuation runs.
_CLIP_SPLIT = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""


def _bytes_to_unicode() -> list[str]:
    """GPT-2/CLIP byte -> printable-unicode table, in CLIP's vocabulary order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return [chr(c) for c in cs]


def build_clip_tokenizer(out_dir: str, texts: Iterable[str] | None = None, max_merges: int = 400,
                         model_max_length: int = 77) -> str:
    """A CLIP-format BPE trained on ``texts`` (default: the shapes captions) saved as a ``CLIPTokenizer``, its
    vocabulary laid out like OpenAI CLIP's so any caption tokenizes below the vocabulary size."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import CLIPTokenizer

    texts = list(texts) if texts is not None else shapes_captions()
    alphabet = _bytes_to_unicode()
    # Same normalizer/pre-tokenizer/suffix as CLIPTokenizer so learned merges are ones it will apply.
    bpe = Tokenizer(models.BPE(end_of_word_suffix="</w>", continuing_subword_prefix=""))
    bpe.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "),
                                           normalizers.Lowercase()])
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_CLIP_SPLIT), behavior="removed",
                                                                      invert=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) * 2 + max_merges, min_frequency=1,
                                  initial_alphabet=alphabet, end_of_word_suffix="</w>", show_progress=False,
                                  special_tokens=[])
    bpe.train_from_iterator(texts, trainer=trainer)
    merges = json.loads(bpe.to_str())["model"]["merges"][:max_merges]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]

    vocab: dict[str, int] = {}
    for token in alphabet + [c + "</w>" for c in alphabet] + ["".join(m) for m in merges]:
        vocab.setdefault(token, len(vocab))
    vocab[BOS_TOKEN] = len(vocab)
    vocab[EOS_TOKEN] = len(vocab)

    os.makedirs(out_dir, exist_ok=True)
    vocab_file = os.path.join(out_dir, "vocab.json")
    merges_file = os.path.join(out_dir, "merges.txt")
    with open(vocab_file, "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(merges_file, "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        f.writelines(f"{a} {b}\n" for a, b in merges)

    tokenizer = CLIPTokenizer.from_pretrained(out_dir, model_max_length=model_max_length)
    tokenizer.model_max_length = model_max_length
    tokenizer.save_pretrained(out_dir)
    logger.info("tokenizer with %d tokens (%d merges) at %s", len(vocab), len(merges), out_dir)
    return out_dir


def build_tiny_clip_text_encoder(out_dir: str | None, hidden_size: int = 32, seed: int = 0,
                                 vocab_size: int | None = None, with_projection: bool = False,
                                 num_hidden_layers: int = 2, max_position_embeddings: int = 77,
                                 bos_token_id: int | None = None, eos_token_id: int | None = None,
                                 pad_token_id: int | None = None):
    """A random 2-layer ``CLIPTextModel`` (``with_projection``: SDXL's ``text_encoder_2`` class), float32, eval
    mode, saved in ``out_dir`` if given; vocabulary and special ids from ``out_dir``'s tokenizer unless given."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    ids: dict[str, int] = {}
    vocab_path = os.path.join(out_dir, "vocab.json") if out_dir else None
    if vocab_path and os.path.isfile(vocab_path):
        with open(vocab_path, encoding="utf-8") as f:
            vocab = json.load(f)
        ids = {"vocab_size": len(vocab), "bos": vocab[BOS_TOKEN], "eos": vocab[EOS_TOKEN]}
    if vocab_size is None:
        if "vocab_size" not in ids:
            raise ValueError("vocab_size is required when out_dir has no vocab.json to read it from")
        vocab_size = ids["vocab_size"]
    bos = bos_token_id if bos_token_id is not None else ids.get("bos", vocab_size - 2)
    eos = eos_token_id if eos_token_id is not None else ids.get("eos", vocab_size - 1)
    pad = pad_token_id if pad_token_id is not None else eos  # CLIPTokenizer pads with <|endoftext|>

    config = CLIPTextConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
                            projection_dim=hidden_size, num_hidden_layers=num_hidden_layers,
                            num_attention_heads=max(1, hidden_size // 8),
                            max_position_embeddings=max_position_embeddings,
                            hidden_act="quick_gelu", bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    model.eval()
    if out_dir is not None:
        model.save_pretrained(out_dir)
    return model


def build_tiny_sd(out_dir: str, seed: int = 0, resolution: int = 32, prediction_type: str = "epsilon") -> str:
    """A tiny SD folder (under 2M parameters) that ``StableDiffusionPipeline.from_pretrained`` loads: unet 32/64,
    the tiny vae, a 2-layer CLIP text encoder, DDPM with SD's betas. Idempotent and atomic."""
    from diffusers import DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    if _folder_complete(out_dir):
        return out_dir
    if resolution % 2:
        raise ValueError(f"resolution must be even (2x VAE downsampling, 2x UNet downsampling), got {resolution}")
    with tempfile.TemporaryDirectory() as work:
        tokenizer, (text_encoder,) = _clip_tokenizer_and_encoders(work, seed, (False,))
        vae = build_tiny_vae(seed + 1, resolution)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 2)
            unet = UNet2DConditionModel(
                sample_size=resolution // 2, in_channels=4, out_channels=4,
                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D",
                                                                                          "CrossAttnUpBlock2D"),
                block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=32, attention_head_dim=8,
                norm_num_groups=8)
        # SD v1 schedule; clip_sample=False because latents are not bounded to [-1, 1]; steps_offset=1 as in SD's
        # own config (diffusers warns on 0).
        scheduler = DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                                  beta_schedule="scaled_linear", clip_sample=False, steps_offset=1,
                                  prediction_type=prediction_type)
        pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                       scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                       requires_safety_checker=False)
        # the BPE files as CLIP ships them (and slow tokenizers read) beside transformers' tokenizer.json
        _save_pipeline_atomically(pipe, out_dir, {f"tokenizer/{f}": os.path.join(work, "clip_tokenizer", f)
                                                  for f in ("vocab.json", "merges.txt")})
    logger.info("built tiny SD pipeline at %s", out_dir)
    return out_dir


def _image_files(folder: str) -> list[str]:
    return sorted(f for f in os.listdir(folder) if f.lower().endswith((".png", ".jpg", ".jpeg", ".webp")))


def vae_pretrain_images(images: str | Sequence[Any], resolution: int) -> torch.Tensor:
    """The tiny vae pre-train's images ``[N, 3, res, res]`` in ``[-1, 1]`` (resized, center-cropped): a folder's
    image files (sorted) or a sequence of PIL images."""
    from PIL import Image

    from .data import ImageTransform

    transform = ImageTransform(resolution, center_crop=True, random_flip=False)
    if isinstance(images, str):
        names = _image_files(images)
        if not names:
            raise ValueError(f"no .png/.jpg/.webp images in {images!r} to pretrain the vae on")
        out = []
        for name in names:
            with Image.open(os.path.join(images, name)) as im:
                out.append(transform(im))
        return torch.stack(out)
    if len(images) == 0:
        raise ValueError("no images to pretrain the vae on")
    return torch.stack([transform(images[i]) for i in range(len(images))])


def _weights_digest(module: torch.nn.Module) -> str:
    """A short hash of every parameter's bytes: ranks that trained in lockstep have equal digests."""
    import hashlib

    h = hashlib.sha256()
    for name, p in module.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def pretrain_tiny_vae(model_dir: str, images: str | Sequence[Any], steps: int = 300, batch_size: int = 16,
                      lr: float = 2e-3, seed: int = 0, kl_weight: float = 1e-6, progress: bool = True,
                      resolution: int = 32, device: str | torch.device = "cpu") -> dict[str, Any]:
    """Train the random tiny vae of ``model_dir`` as an autoencoder (MSE + ``kl_weight`` KL), then set
    ``scaling_factor = 1 / std(latents)`` (and ``shift_factor`` = their mean where the vae has one); saved in place
    by rank 0. Collective: every rank takes the same step on its rows of one seeded batch. Idempotent
    (``vae/pretrained.json``); returns the same figures (mse, factors, seconds, rank digests...) on every rank."""
    import time

    import torch.distributed as dist
    from diffusers import AutoencoderKL
    from multiengine.engines import all_reduce_sum, global_moments
    from tqdm import tqdm

    grouped = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if grouped else (0, 1)
    vae_dir = os.path.join(model_dir, "vae")
    marker = os.path.join(vae_dir, "pretrained.json")
    n_images = len(_image_files(images)) if isinstance(images, str) else len(images)
    if os.path.isfile(marker):
        with open(marker, encoding="utf-8") as f:
            done = json.load(f)
        if [done.get(k) for k in ("steps", "seed", "resolution", "images")] == [steps, seed, resolution, n_images]:
            if rank == 0:
                logger.info("the tiny vae at %s is already pretrained (%s steps at %s px): kept", vae_dir, steps,
                            resolution)
            return done
    if rank == 0:
        logger.info("pretraining the tiny vae: %d steps of %d images (of %d) at %d px on %d ranks", steps,
                    batch_size, n_images, resolution, world)
    pixels = vae_pretrain_images(images, resolution)
    if batch_size < world:
        raise ValueError(f"batch_size={batch_size} < {world} ranks: each rank needs a row of every batch")
    vae = AutoencoderKL.from_pretrained(vae_dir).to(device)
    vae.train()
    params = [p for p in vae.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    generator = torch.Generator().manual_seed(seed)
    mse = float("nan")
    start = time.perf_counter()
    bar = tqdm(range(steps), desc=f"tiny vae pretraining ({resolution} px, {world} ranks)",
               disable=not (progress and rank == 0))
    for _ in bar:
        # The same draws on every rank (indices, then the whole batch's noise): rank r takes rows r::W.
        index = torch.randint(0, len(pixels), (batch_size,), generator=generator)
        mine = slice(rank, batch_size, world)
        batch = pixels[index[mine]].to(device)
        posterior = vae.encode(batch).latent_dist
        noise = torch.randn((batch_size, *posterior.mean.shape[1:]), generator=generator)[mine]
        recon = vae.decode(posterior.mean + posterior.std * noise.to(device)).sample
        loss = torch.nn.functional.mse_loss(recon, batch)
        share = len(batch) / batch_size  # the batch mean is the sum over ranks of share x the rank's mean
        optimizer.zero_grad(set_to_none=True)
        ((loss + kl_weight * posterior.kl().mean()) * share).backward()
        if world > 1:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads] + [loss.detach().reshape(1) * share])
            flat = all_reduce_sum(flat).to(device=device, dtype=flat.dtype)
            offset = 0
            for p, g in zip(params, grads):
                p.grad = flat[offset:offset + g.numel()].view_as(g)
                offset += g.numel()
            mse = float(flat[-1])
        else:
            mse = loss.item()
        optimizer.step()
        bar.set_postfix(mse=f"{mse:.4f}", refresh=False)
    bar.close()
    vae.eval()
    with torch.no_grad():
        # Latent statistics over every image: rank r encodes images r::W, one all-reduce of the moments.
        own = pixels[rank::world]
        means = [vae.encode(own[i:i + 64].to(device)).latent_dist.mean.cpu() for i in range(0, len(own), 64)]
        mean, std, count = global_moments(torch.cat(means) if means else torch.zeros(0))
    std *= math.sqrt(count / max(count - 1.0, 1.0))  # the unbiased std, as torch.std gives on one rank
    vae.register_to_config(scaling_factor=1.0 / std)
    if getattr(vae.config, "shift_factor", None) is not None:
        # SD3 / FLUX vaes centre their latents too ((z - shift) * scale), as their published shift_factor does.
        vae.register_to_config(shift_factor=float(mean))
    mine = (_weights_digest(vae), time.perf_counter() - start)
    ranks = [mine]
    if world > 1:
        ranks = [None] * world
        dist.all_gather_object(ranks, mine)
    digests = [d for d, _ in ranks]
    result = {"mse": mse, "scaling_factor": 1.0 / std, "steps": steps, "seed": seed,
              "shift_factor": getattr(vae.config, "shift_factor", None), "resolution": resolution,
              "images": n_images, "world_size": world, "seconds": round(max(t for _, t in ranks), 2),
              "rank_digests": digests}
    if len(set(digests)) > 1:
        logger.warning("tiny vae pretraining: the ranks' weights differ (%s); rank 0's are saved", digests)
    if rank == 0:
        tmp = vae_dir + ".tmp"
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)
        vae.to("cpu").save_pretrained(tmp, safe_serialization=True)
        with open(os.path.join(tmp, "pretrained.json"), "w", encoding="utf-8") as f:
            json.dump(result, f)
        shutil.rmtree(vae_dir)
        os.replace(tmp, vae_dir)
        logger.info("pretrained the tiny vae for %d steps at %d px on %d ranks in %.1f s: reconstruction MSE "
                    "%.4f, scaling_factor %.4f", steps, resolution, world, result["seconds"], mse, 1.0 / std)
    return result


# --- the other families: SDXL, SD3 (CLIP-L + CLIP-G + T5) and FLUX (CLIP-L + T5) ------------------------------
T5_SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2 as in T5's vocabulary


def build_t5_tokenizer(out_dir: str, texts: Iterable[str] | None = None, model_max_length: int = 512) -> str:
    """A ``T5TokenizerFast`` whose Unigram vocabulary has every word of ``texts`` as one piece plus ASCII fall-backs
    (``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2); written out: the trainer keeps only characters on so small a corpus."""
    import collections
    import math
    import string

    from transformers import T5TokenizerFast

    texts = list(texts) if texts is not None else shapes_captions()
    counts = collections.Counter(w for t in texts for w in t.split())
    total = sum(counts.values()) or 1
    vocab: list[tuple[str, float]] = [(t, 0.0) for t in T5_SPECIAL_TOKENS]
    vocab += [("\u2581" + w, math.log(c / total)) for w, c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    seen = {p for p, _ in vocab}
    # A word built from k fall-back pieces scores about -20 k: any listed word wins over its characters.
    fallback = ["\u2581"] + sorted({c for w in counts for c in w} | set(string.ascii_letters + string.digits
                                                                      + string.punctuation))
    vocab += [(p, -20.0) for p in fallback if p not in seen]
    tokenizer = T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=model_max_length)
    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    logger.info("T5 tokenizer with %d pieces (%d words) at %s", len(vocab), len(counts), out_dir)
    return out_dir


def build_tiny_t5_encoder(out_dir: str | None, vocab_size: int, d_model: int = 64, seed: int = 0,
                          num_layers: int = 2, num_heads: int = 4):
    """A random ``T5EncoderModel`` (SD3's ``text_encoder_3``, FLUX's ``text_encoder_2``), saved in ``out_dir`` if
    given; ``vocab_size`` must match the tokenizer."""
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=vocab_size, d_model=d_model, d_kv=d_model // num_heads, d_ff=d_model * 2, num_layers=num_layers,
        num_heads=num_heads, relative_attention_num_buckets=8, relative_attention_max_distance=32,
        dropout_rate=0.0, feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = T5EncoderModel(config)
    model.eval()
    if out_dir is not None:
        model.save_pretrained(out_dir)
    return model


def build_tiny_vae(seed: int = 0, resolution: int = 32, latent_channels: int = 4, flow: bool = False):
    """The tiny ``AutoencoderKL`` (32/64 channels, 2x downsampling): SD's with ``latent_channels=4``; ``flow=True``
    like SD3/FLUX's (no quant convs, ``shift_factor``; scale 1 until :func:`pretrain_tiny_vae` measures it)."""
    from diffusers import AutoencoderKL

    extra = {"use_quant_conv": False, "use_post_quant_conv": False, "shift_factor": 0.0,
             "scaling_factor": 1.0} if flow else {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoencoderKL(
            in_channels=3, out_channels=3,
            down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
            block_out_channels=(32, 64), layers_per_block=1, latent_channels=latent_channels, norm_num_groups=8,
            sample_size=resolution, **extra,
        )


def _folder_complete(out_dir: str) -> bool:
    """model_index.json present and every component it names is a non-empty folder."""
    index = os.path.join(out_dir, "model_index.json")
    if not os.path.isfile(index):
        return False
    with open(index, encoding="utf-8") as f:
        components = [k for k, v in json.load(f).items() if isinstance(v, list) and v and v[0]]
    return all(os.path.isdir(os.path.join(out_dir, c)) and os.listdir(os.path.join(out_dir, c)) for c in components)


def _save_pipeline_atomically(pipe, out_dir: str, extra: dict[str, str] | None = None) -> str:
    """``pipe.save_pretrained`` (plus ``extra`` files) into a temporary sibling renamed into place; a folder another
    caller completed first is kept."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny_", dir=parent)
    try:
        pipe.save_pretrained(tmp, safe_serialization=True)
        for name, source in (extra or {}).items():
            shutil.copyfile(source, os.path.join(tmp, name))
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would make the folder private to this user
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if _folder_complete(out_dir):
                return out_dir
            for name in sorted(os.listdir(tmp), key=lambda x: x == "model_index.json"):  # the marker last
                dst = os.path.join(out_dir, name)
                if os.path.isdir(dst):
                    shutil.rmtree(dst)
                os.replace(os.path.join(tmp, name), dst)
        return out_dir
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def _clip_tokenizer_and_encoders(workdir: str, seed: int, projections: Iterable[bool], hidden_size: int = 32):
    """One CLIP tokenizer (trained on the shapes captions) and a tiny CLIP encoder per entry of
    ``projections`` (True: ``CLIPTextModelWithProjection``), seeded ``seed``, ``seed + 3``, ..."""
    from transformers import CLIPTokenizer

    tok = CLIPTokenizer.from_pretrained(build_clip_tokenizer(os.path.join(workdir, "clip_tokenizer")))
    encoders = []
    for i, with_projection in enumerate(projections):
        encoders.append(build_tiny_clip_text_encoder(
            None, hidden_size=hidden_size, seed=seed + 3 * i, with_projection=with_projection, vocab_size=len(tok),
            max_position_embeddings=tok.model_max_length, bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    return tok, encoders


def _t5(workdir: str, seed: int, d_model: int):
    from transformers import T5TokenizerFast

    tok = T5TokenizerFast.from_pretrained(build_t5_tokenizer(os.path.join(workdir, "t5_tokenizer")))
    return tok, build_tiny_t5_encoder(None, vocab_size=len(tok), d_model=d_model, seed=seed)


def _check_resolution(resolution: int, multiple: int, family: str) -> None:
    if resolution < multiple or resolution % multiple:
        raise ValueError(f"resolution={resolution}: the tiny {family} model needs a multiple of {multiple}.")


def build_tiny_sdxl(out_dir: str, seed: int = 0, resolution: int = 32) -> str:
    """A tiny SDXL folder: the tiny vae, two CLIP text encoders (hidden 32) sharing one tokenizer, a unet with
    cross-attention 32 + 32 and ``text_time`` embeddings, DDPM. Idempotent and atomic."""
    from diffusers import DDPMScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTokenizer

    if _folder_complete(out_dir):
        return out_dir
    _check_resolution(resolution, 4, "sdxl")
    with tempfile.TemporaryDirectory() as work:
        tok = CLIPTokenizer.from_pretrained(build_clip_tokenizer(os.path.join(work, "tok")))
        kw = {"hidden_size": 32, "vocab_size": len(tok), "max_position_embeddings": tok.model_max_length,
              "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
        text_encoder = build_tiny_clip_text_encoder(None, seed=seed, **kw)
        text_encoder_2 = build_tiny_clip_text_encoder(None, seed=seed + 3, with_projection=True, **kw)
        vae = build_tiny_vae(seed + 1, resolution)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 4)
            unet = UNet2DConditionModel(
                sample_size=resolution // 2, in_channels=4, out_channels=4,
                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
                block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=64, attention_head_dim=8,
                norm_num_groups=8, addition_embed_type="text_time", addition_time_embed_dim=8,
                projection_class_embeddings_input_dim=6 * 8 + 32,
            )
        scheduler = DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                                  beta_schedule="scaled_linear", clip_sample=False, steps_offset=1)
        pipe = StableDiffusionXLPipeline(
            vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2, tokenizer=tok, tokenizer_2=tok,
            unet=unet, scheduler=scheduler, force_zeros_for_empty_prompt=True, add_watermarker=False)
        _save_pipeline_atomically(pipe, out_dir)
    logger.info("built tiny SDXL pipeline at %s", out_dir)
    return out_dir


def build_tiny_sd3(out_dir: str, seed: int = 0, resolution: int = 32) -> str:
    """A tiny SD3 folder: two CLIP encoders with projection (32 each) sharing one tokenizer, a T5 encoder (64), a
    16-channel vae, ``SD3Transformer2DModel`` (2 layers, 4 heads x 8, joint width 64), FlowMatchEuler(shift=3)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    if _folder_complete(out_dir):
        return out_dir
    _check_resolution(resolution, 4, "sd3")
    with tempfile.TemporaryDirectory() as work:
        clip_tok, (clip_l, clip_g) = _clip_tokenizer_and_encoders(work, seed, (True, True))
        t5_tok, t5 = _t5(work, seed + 5, d_model=64)
        vae = build_tiny_vae(seed + 1, resolution, latent_channels=16, flow=True)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 2)
            transformer = SD3Transformer2DModel(
                sample_size=resolution // 2, patch_size=2, in_channels=16, out_channels=16, num_layers=2,
                attention_head_dim=8, num_attention_heads=4, joint_attention_dim=64, caption_projection_dim=32,
                pooled_projection_dim=64, pos_embed_max_size=max(16, resolution // 2),
            )
        pipe = StableDiffusion3Pipeline(
            transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
            vae=vae, text_encoder=clip_l, tokenizer=clip_tok, text_encoder_2=clip_g, tokenizer_2=clip_tok,
            text_encoder_3=t5, tokenizer_3=t5_tok)
        _save_pipeline_atomically(pipe, out_dir)
    logger.info("built tiny SD3 pipeline at %s", out_dir)
    return out_dir


def build_tiny_flux(out_dir: str, seed: int = 0, resolution: int = 32, guidance_embeds: bool = True) -> str:
    """A tiny FLUX folder: CLIP (32) and T5 (64) encoders, a 16-channel vae, ``FluxTransformer2DModel`` (1 double + 1
    single block, 2 heads x 16, guidance embeds), FLUX.1-dev's scheduler. Idempotent and atomic."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    if _folder_complete(out_dir):
        return out_dir
    _check_resolution(resolution, 4, "flux")
    with tempfile.TemporaryDirectory() as work:
        clip_tok, (clip_l,) = _clip_tokenizer_and_encoders(work, seed, (False,))
        t5_tok, t5 = _t5(work, seed + 5, d_model=64)
        vae = build_tiny_vae(seed + 1, resolution, latent_channels=16, flow=True)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 2)
            transformer = FluxTransformer2DModel(
                patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
                num_attention_heads=2, joint_attention_dim=64, pooled_projection_dim=32,
                guidance_embeds=guidance_embeds, axes_dims_rope=(4, 6, 6),
            )
        scheduler = FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
            base_image_seq_len=256, max_image_seq_len=4096)
        pipe = FluxPipeline(transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=clip_l,
                            tokenizer=clip_tok, text_encoder_2=t5, tokenizer_2=t5_tok)
        _save_pipeline_atomically(pipe, out_dir)
    logger.info("built tiny FLUX pipeline at %s", out_dir)
    return out_dir


def build_tiny(family: str, path: str, seed: int = 0, resolution: int = 32) -> str:
    """The tiny folder of ``family`` (``sd``, ``sdxl``, ``sd3``, ``flux``) at ``path``; see the builders."""
    builders = {"sd": build_tiny_sd, "sdxl": build_tiny_sdxl, "sd3": build_tiny_sd3, "flux": build_tiny_flux}
    if family not in builders:
        raise ValueError(f"family={family!r}; the tiny builders are {sorted(builders)}.")
    return builders[family](path, seed=seed, resolution=resolution)

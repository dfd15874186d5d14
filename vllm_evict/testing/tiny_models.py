"""Small HF-format checkpoints that vLLM loads, built locally (no model hub).

`ensure_tiny_model("llama"|"qwen2")` writes a GQA model (4 query / 2 KV heads, head_dim 64, random
weights from a fixed seed) with a byte-level BPE tokenizer trained with `tokenizers` and a ChatML
chat template. The hybrid kinds have the same attention heads: "gemma3" (two sliding-window layers of
32 tokens to one full-attention layer, twice; float32), "gpt-oss" (sliding window 32 alternating with
full attention, attention sinks, a 4-expert MoE; "gpt-oss-6" with three layers of each) and "qwen3-next"
(three Gated DeltaNet layers to one full-attention layer, a 4-expert MoE); the GPT-OSS and Qwen3-Next kinds
in bfloat16, the dtype vLLM's CPU kernels for sinks and Gated DeltaNet take. `write_real_config(NAME)`
writes only config + tokenizer of a real model (REAL_CONFIGS: Llama-3.1-8B, Qwen2.5-7B, GPT-OSS-20B,
Gemma-3-12B, Qwen3-Next-80B-A3B's layers with fewer experts) for `load_format="dummy"` runs.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_VERSION = 1  # bump when the recipe changes so caches rebuild

TINY_SHAPES = {
    "llama": dict(num_hidden_layers=3, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64),
    "qwen2": dict(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=2),
    "gemma3": dict(num_hidden_layers=6, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64, sliding_window=32,
                   layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2
                   + ["full_attention"]),
    "gpt-oss": dict(num_hidden_layers=4, hidden_size=256, intermediate_size=256, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, sliding_window=32, num_local_experts=4,
                    num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"] * 2),
    # three of each: a speculative draft's full-attention layer (EAGLE3) joins the full-attention KV cache group,
    # as on GPT-OSS-20B (12 + 13 layers); vLLM splits the layers of a type past 1.5x the other type's count
    "gpt-oss-6": dict(num_hidden_layers=6, hidden_size=256, intermediate_size=256, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, sliding_window=32, num_local_experts=4,
                      num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"] * 3),
    "qwen3-next": dict(num_hidden_layers=4, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=32, linear_value_head_dim=32, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=128, shared_expert_intermediate_size=128,
                       layer_types=["linear_attention"] * 3 + ["full_attention"]),
}
# vLLM's CPU sinks and Gated DeltaNet run in bf16 only
TINY_DTYPES = {"gpt-oss": "bfloat16", "gpt-oss-6": "bfloat16", "qwen3-next": "bfloat16"}

REAL_CONFIGS = {
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        hidden_act="silu", tie_word_embeddings=False, torch_dtype="bfloat16",
        bos_token_id=128000, eos_token_id=128001),
    "qwen2.5-7b": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0, hidden_act="silu",
        tie_word_embeddings=False, torch_dtype="bfloat16", use_sliding_window=False,
        bos_token_id=151643, eos_token_id=151645),
    # hybrids, written through transformers' own config class (its layer_types and rope_parameters)
    "gpt-oss-20b": dict(  # unquantized (bf16 experts): the MXFP4 checkpoint's shapes
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=2880, intermediate_size=2880,
        num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
        num_experts_per_tok=4, sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 12,
        vocab_size=201088, max_position_embeddings=131072, rms_norm_eps=1e-5, attention_bias=True,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
        tie_word_embeddings=False, torch_dtype="bfloat16"),
    "gemma-3-12b": dict(  # the text model of Gemma 3 12B: 5 sliding-window (1,024) layers to 1 global
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=3840, intermediate_size=15360,
        num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
        query_pre_attn_scalar=256, sliding_window=1024,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 8, vocab_size=262208,
        max_position_embeddings=131072, rms_norm_eps=1e-6,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        tie_word_embeddings=True, torch_dtype="bfloat16"),
    # Qwen3-Next-80B-A3B's layers (three Gated DeltaNet layers to one gated full-attention layer, 2 KV heads of
    # 256) with 64 of its 512 experts, so that it fits one 80 GB GPU: the experts change the MoE weights only,
    # not the KV cache layout or the active parameters (10 routed + 1 shared expert per token)
    "qwen3-next-80b-a3b-64e": dict(
        architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", hidden_size=2048, intermediate_size=5120,
        num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_experts=64, num_experts_per_tok=10, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, decoder_sparse_step=1, norm_topk_prob=True,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 12, vocab_size=151936,
        max_position_embeddings=262144, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False, torch_dtype="bfloat16"),
}
HYBRID_CONFIGS = ("gpt-oss-20b", "gemma-3-12b", "qwen3-next-80b-a3b-64e")


def default_cache_dir() -> Path:
    return Path(os.environ.get("VLLM_EVICT_CACHE", Path.home() / ".cache" / "vllm-evict")) / "models"


def _training_text() -> list[str]:
    words = ("the a an of to in is was for on with as by at from key value pass number city river "
             "blue green red sky grass sun moon code token cache page head layer attention query "
             "memory model request budget policy evict keep score window prompt answer question").split()
    lines = []
    for i in range(400):
        lines.append(" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12)) + f" {i} {i * 37 % 1000}.")
    return lines + [str(d) for d in range(10)] * 10


def _build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_training_text(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 4096
    return fast


def _config(kind: str, vocab_size: int, tok):
    from transformers import Gemma3TextConfig, GptOssConfig, LlamaConfig, Qwen2Config, Qwen3NextConfig

    common = dict(vocab_size=vocab_size, max_position_embeddings=4096, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id, torch_dtype=TINY_DTYPES.get(kind, "float32"), **TINY_SHAPES[kind])
    if kind == "llama":
        return LlamaConfig(rope_theta=10000.0, **common)
    if kind == "gemma3":
        return Gemma3TextConfig(architectures=["Gemma3ForCausalLM"], **common)
    if kind.startswith("gpt-oss"):
        return GptOssConfig(architectures=["GptOssForCausalLM"], **common)
    if kind == "qwen3-next":
        return Qwen3NextConfig(architectures=["Qwen3NextForCausalLM"], **common)
    return Qwen2Config(use_sliding_window=False, rope_theta=10000.0, **common)


def ensure_tiny_model(kind: str = "llama", cache_dir: str | Path | None = None, seed: int = 0) -> Path:
    """Build (once) and return the directory of a tiny random-weight `kind` model."""
    import torch
    from transformers import AutoModelForCausalLM

    if kind not in TINY_SHAPES:
        raise ValueError(f"unknown tiny model kind {kind!r}; choose from {sorted(TINY_SHAPES)}")
    path = Path(cache_dir or default_cache_dir()) / f"tiny-{kind}-v{TINY_VERSION}-s{seed}"
    if (path / "READY").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    tok = _build_tokenizer(vocab_size=1024)
    vocab_size = len(tok)
    config = _config(kind, vocab_size, tok)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, TINY_DTYPES.get(kind, "float32")))
    with torch.no_grad():  # larger-than-default weights give peaked, input-dependent attention
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.normal_(0.0, 0.08)
            elif name.endswith("sinks"):  # sinks that take a visible share of each softmax
                p.normal_(0.0, 1.0)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    if kind in ("llama", "qwen2"):
        cfg.setdefault("rope_theta", 10000.0)  # transformers 5 may write only rope_parameters
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    (path / "READY").write_text("ok\n")
    return path


def tiny_eagle_draft(target: str | Path) -> Path:
    """The config of a one-layer EAGLE draft for a tiny Llama (beside it), for vLLM's speculative method
    "eagle" with `draft_load_config={"load_format": "dummy"}`: its attention layer has the target's shape,
    so vLLM puts its KV cache in the target's KV cache group."""
    target = Path(target)
    path = target / "eagle-draft"
    path.mkdir(exist_ok=True)
    cfg = json.loads((target / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def tiny_eagle3_draft(target: str | Path) -> Path:
    """The config of a one-layer EAGLE3 draft (Llama layer, the target's attention heads, reading three of the
    target's hidden states) beside a GPT-OSS `target` (a tiny one, or a real config), for vLLM's speculative
    method "eagle3" with `draft_load_config={"load_format": "dummy"}`."""
    target = Path(target)
    path = target / "eagle3-draft"
    path.mkdir(exist_ok=True)
    cfg = json.loads((target / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    draft = {key: cfg[key] for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                       "vocab_size", "max_position_embeddings", "rms_norm_eps", "bos_token_id",
                                       "eos_token_id")}
    draft.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                 intermediate_size=2 * cfg["hidden_size"], draft_vocab_size=cfg["vocab_size"], rope_theta=10000.0,
                 torch_dtype=cfg.get("torch_dtype", "bfloat16"), tie_word_embeddings=False,
                 eagle_aux_hidden_state_layer_ids=[1, layers // 2, layers - 2])
    (path / "config.json").write_text(json.dumps(draft, indent=2))
    return path


def tiny_mtp_model(target: str | Path) -> Path:
    """A Qwen3-Next `target` (a tiny one, or a real config) again beside it, its config asking for one
    multi-token-prediction (MTP) layer, for vLLM's speculative method "mtp" with
    `draft_load_config={"load_format": "dummy"}`: the target's files (links), and an MTP draft whose
    full-attention layer vLLM puts in the target's full-attention KV cache group."""
    target = Path(target)
    path = target / "mtp"
    path.mkdir(exist_ok=True)
    for item in target.iterdir():
        if item.is_file() and item.name != "config.json" and not (path / item.name).exists():
            (path / item.name).symlink_to(item)
    cfg = json.loads((target / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def write_real_config(name: str, cache_dir: str | Path | None = None) -> Path:
    """Config + a tiny tokenizer of a real model, for `load_format="dummy"` runs at its real shape."""
    if name not in REAL_CONFIGS:
        raise ValueError(f"unknown real config {name!r}; choose from {sorted(REAL_CONFIGS)}")
    path = Path(cache_dir or default_cache_dir()) / f"dummy-{name}"
    path.mkdir(parents=True, exist_ok=True)
    tok = _build_tokenizer(vocab_size=1024)
    tok.save_pretrained(path)
    cfg = dict(REAL_CONFIGS[name])
    cfg["bos_token_id"], cfg["eos_token_id"] = tok.bos_token_id, tok.eos_token_id
    if name in HYBRID_CONFIGS:
        from transformers import AutoConfig

        cfg = AutoConfig.for_model(**cfg).to_dict()
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def register(subparsers) -> None:
    p = subparsers.add_parser("make-tiny", help="build a tiny local model (or a real model's config)")
    p.add_argument("kind", nargs="?", default="llama", help=f"{sorted(TINY_SHAPES)} or {sorted(REAL_CONFIGS)}")
    p.add_argument("--cache-dir", default=None)
    p.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    if args.kind in REAL_CONFIGS:
        print(write_real_config(args.kind, args.cache_dir))
    else:
        print(ensure_tiny_model(args.kind, args.cache_dir))
    return 0

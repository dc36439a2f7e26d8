"""Tiny model directories for real vLLM engines: a config.json per architecture and the project's
toy tokenizer (trained locally with the ``tokenizers`` library, chat template included).

Engines run them with ``--load-format dummy`` (random weights): the text they generate is gibberish,
but the KV cache, its groups, prefix hits, events and usage counters are vLLM's own. Nothing is
downloaded. Each shape is the smallest that vLLM's CPU backend starts and that still has the cache
layout of the family it stands for:

- ``llama``: one full-attention KV cache group;
- ``gemma3``: sliding-window layers (window 64) alternating with full attention: two groups, the
  sliding one keeps only the blocks its window still needs;
- ``qwen3_next``: Gated DeltaNet (Mamba-like state) layers and one full-attention layer; the CPU
  kernels need linear head dims of 128, and vLLM raises the block to 544 tokens so one attention
  page holds as much as one state.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sim.toy_tokenizer import BOS_TOKEN, EOS_TOKEN, SPECIAL_TOKENS, build_toy_tokenizer

VOCAB = 2048
"""The toy tokenizer's vocabulary; the embedding tables are this size."""

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": SPECIAL_TOKENS.index(BOS_TOKEN),
    "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
    "pad_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
}

CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        **_COMMON,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 2,
        "hidden_act": "silu",
        "rope_theta": 10000.0,
    },
    "gemma3": {
        **_COMMON,
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "num_hidden_layers": 4,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 64,
        "sliding_window": 64,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
    },
    "qwen3_next": {
        **_COMMON,
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "full_attention_interval": 4,
        "hidden_act": "silu",
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000.0,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0, 1, 2],
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
        "norm_topk_prob": True,
    },
}


def write_model(directory: Path, kind: str) -> Path:
    """Write the model directory of ``kind`` (a key of :data:`CONFIGS`) and return it."""
    directory.mkdir(parents=True, exist_ok=True)
    build_toy_tokenizer(directory, vocab_size=VOCAB)
    (directory / "config.json").write_text(json.dumps(CONFIGS[kind], indent=2, sort_keys=True) + "\n")
    return directory

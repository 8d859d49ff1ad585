"""Tiny random decoder-only models of the families people quantize to FP4, built from
configs (no trained weights needed): the shapes and code paths of each family, with the
traits that break things (tied embeddings, sliding windows, soft-capping, offset norms,
q/k norms, biases, fused projections)."""

from __future__ import annotations

from pathlib import Path

import torch

#: family -> (transformers model class, config class, config overrides, traits)
FAMILIES: dict[str, tuple[str, str, dict, str]] = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", {"tie_word_embeddings": True},
              "tied embeddings"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {"tie_word_embeddings": False},
              "q/k/v biases"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {"tie_word_embeddings": True},
              "q/k norms, tied embeddings"),
    "mistral": ("MistralForCausalLM", "MistralConfig", {"sliding_window": 32},
                "sliding-window attention"),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config",
               {"sliding_window": 32, "attn_logit_softcapping": 50.0,
                "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 32},
               "soft-capping, sliding window, offset norms"),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig",
               {"sliding_window": 32, "query_pre_attn_scalar": 32},
               "offset norms, q/k norms, sliding window"),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", {"pad_token_id": 0},
             "q/k/v and gate/up stored fused"),
}

#: Mixture-of-Experts families (8 experts, 2 per token): transformers 5 keeps their
#: experts as 3-D parameters; Qwen2-MoE adds a shared expert and its gate, Mixtral stores
#: experts under other names (block_sparse_moe.experts.N.w1) than the linearized modules
MOE_FAMILIES: dict[str, tuple[str, str, dict, str]] = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                  {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                   "decoder_sparse_step": 1}, "routed experts, q/k norms"),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                  {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                   "shared_expert_intermediate_size": 128, "decoder_sparse_step": 1},
                  "routed + shared expert with its gate, q/k/v biases"),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig",
                {"num_local_experts": 8, "num_experts_per_tok": 2},
                "routed experts stored as w1/w2/w3"),
}

#: families whose real tokenizers start every sequence with BOS (Llama 3's
#: <|begin_of_text|>, Mistral's and Mixtral's <s>, Gemma's <bos>); Qwen's and Phi-3's add
#: none. The copied tokenizer is configured alike, so windows start as they do when served.
BOS_FAMILIES = {"llama", "mistral", "gemma2", "gemma3", "mixtral"}

COMMON = {"vocab_size": 49152, "hidden_size": 128, "intermediate_size": 256,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 32, "max_position_embeddings": 1024,
          # wider than the default 0.02, so next-token distributions are far from uniform
          # and a numerics error in vLLM or in the checkpoint shows in the log-probs
          "initializer_range": 0.1}


def make_family_model(family: str, path: Path, tokenizer_from: Path | None = None,
                      seed: int = 0) -> Path:
    """Save a 2-block random ``family`` model (bf16) at ``path``; copy a tokenizer in,
    adding BOS to sequences as the family's real tokenizer does (:data:`BOS_FAMILIES`)."""
    import transformers

    model_cls, config_cls, overrides, _ = {**FAMILIES, **MOE_FAMILIES}[family]
    config = getattr(transformers, config_cls)(**{**COMMON, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(torch.bfloat16)
    model.save_pretrained(path)
    if tokenizer_from is not None:
        tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_from)
        tokenizer.add_bos_token = family in BOS_FAMILIES
        tokenizer.save_pretrained(path)
    return path

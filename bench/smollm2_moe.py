"""SmolLM2-MoE: a Mixture-of-Experts model with real trained weights, built from the
bundled SmolLM2-135M (no MoE with trained weights can be downloaded here).

What it is, exactly: the Qwen2-MoE architecture of transformers 5 (routed experts as 3-D
parameters, a shared expert with a sigmoid gate, a router), with SmolLM2's embeddings,
norms and attention copied unchanged (Qwen2-MoE attention with zero q/k/v biases is
Llama's; Qwen3-MoE's q/k norms would change it. The biases are stored, as zeros: vLLM
0.32's Qwen2-MoE always builds them, ignoring ``qkv_bias=False``). Each block's dense MLP
(1536 SiLU-gated neurons) is split by neuron:

- the 512 neurons with the largest gate-row norms form the shared expert; its gate's
  weights are zero, so it passes sigmoid(0) = 1/2 and its down projection is doubled;
- the other 1024 neurons form 8 experts of 128, grouped by balanced k-means on their
  gate rows (neurons that read similar directions share an expert); each expert's down
  projection is multiplied by ``top_k`` and the router renormalizes the chosen experts'
  weights (``norm_topk_prob``);
- the router's rows are the experts' centroids times 1e-3: tokens go to the experts
  whose neurons point their way, with weights of 1/top_k (to within 1e-3).

With ``top_k = 8`` (every expert active) the model computes the dense SmolLM2 (the
scalings are powers of two, exact in bf16; :func:`check_dense` measures the difference).
With ``top_k = 4`` it is a real sparse MoE that drops half of each token's routed
neurons: not the dense model, and its perplexity says how far.

    .venv/bin/python -m bench smollm2_moe OUT_DIR [--top-k 4]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

EXPERTS, EXPERT_NEURONS, SHARED_NEURONS = 8, 128, 512


def _balanced_kmeans(rows: np.ndarray, k: int, size: int, iters: int = 20,
                     seed: int = 0) -> list[np.ndarray]:
    """k groups of exactly ``size`` rows (unit vectors), near their centroids."""
    rng = np.random.default_rng(seed)
    centroids = rows[rng.choice(len(rows), k, replace=False)]
    for _ in range(iters):
        score = rows @ centroids.T  # cosine similarity
        order = np.argsort(-score, axis=None)  # greedy: best (row, group) pairs first
        group = -np.ones(len(rows), dtype=int)
        room = np.full(k, size)
        for flat in order:
            r, g = divmod(int(flat), k)
            if group[r] < 0 and room[g] > 0:
                group[r], room[g] = g, room[g] - 1
        centroids = np.stack([rows[group == g].mean(0) for g in range(k)])
        centroids /= np.linalg.norm(centroids, axis=1, keepdims=True)
    return [np.flatnonzero(group == g) for g in range(k)]


@torch.no_grad()
def build(out: Path, top_k: int = 4, source: Path | None = None) -> Path:
    """Write SmolLM2-MoE (bf16 safetensors, SmolLM2's tokenizer) to ``out``."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer, Qwen2MoeConfig, Qwen2MoeForCausalLM

    from fp4sense.inputs.assets import ensure_model

    source = Path(source or ensure_model(log=lambda msg: None))
    dense = AutoConfig.from_pretrained(source)
    state = load_file(str(source / "model.safetensors"))
    config = Qwen2MoeConfig(
        vocab_size=dense.vocab_size, hidden_size=dense.hidden_size,
        num_hidden_layers=dense.num_hidden_layers,
        num_attention_heads=dense.num_attention_heads,
        num_key_value_heads=dense.num_key_value_heads,
        max_position_embeddings=dense.max_position_embeddings,
        rms_norm_eps=dense.rms_norm_eps, rope_parameters=dense.rope_parameters,
        tie_word_embeddings=dense.tie_word_embeddings, hidden_act=dense.hidden_act,
        bos_token_id=dense.bos_token_id, eos_token_id=dense.eos_token_id,
        pad_token_id=dense.pad_token_id, qkv_bias=True,
        num_experts=EXPERTS, num_experts_per_tok=top_k, norm_topk_prob=True,
        moe_intermediate_size=EXPERT_NEURONS, shared_expert_intermediate_size=SHARED_NEURONS,
        decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False)
    assert SHARED_NEURONS + EXPERTS * EXPERT_NEURONS == dense.intermediate_size
    model = Qwen2MoeForCausalLM(config).to(torch.bfloat16)
    own = model.state_dict()
    for name in own:  # embeddings, norms, attention: SmolLM2's own (biases zero)
        if name in state:
            own[name].copy_(state[name])
        elif name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
            own[name].zero_()
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}.mlp"
        gate, up, down = (state[f"{p}.{w}_proj.weight"] for w in ("gate", "up", "down"))
        norms = gate.float().norm(dim=1)
        shared = torch.argsort(norms, descending=True)[:SHARED_NEURONS].sort().values
        rest = np.setdiff1d(np.arange(gate.shape[0]), shared.numpy())
        rows = gate[rest].float().numpy()
        rows = rows / np.linalg.norm(rows, axis=1, keepdims=True)
        groups = _balanced_kmeans(rows, EXPERTS, EXPERT_NEURONS, seed=i)
        mlp = layer.mlp
        mlp.shared_expert.gate_proj.weight.copy_(gate[shared])
        mlp.shared_expert.up_proj.weight.copy_(up[shared])
        mlp.shared_expert.down_proj.weight.copy_(down[:, shared] * 2)
        mlp.shared_expert_gate.weight.zero_()
        centroids = []
        for e, g in enumerate(groups):
            idx = torch.as_tensor(rest[np.sort(g)])
            mlp.experts.gate_up_proj[e].copy_(torch.cat([gate[idx], up[idx]]))
            mlp.experts.down_proj[e].copy_(down[:, idx] * top_k)
            c = gate[idx].float().mean(0)
            centroids.append(c / c.norm())
        mlp.gate.weight.copy_(torch.stack(centroids) * 1e-3 if top_k < EXPERTS else 0)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out


@torch.no_grad()
def check_dense(moe: Path, tokens: torch.Tensor) -> dict:
    """Largest |logit difference| and both perplexities, MoE vs the dense SmolLM2, on
    ``tokens`` (1, T), float32."""
    from transformers import AutoModelForCausalLM

    from fp4sense.inputs.assets import ensure_model

    out = {}
    for key, path in (("dense", ensure_model(log=lambda m: None)), ("moe", moe)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        logits = model(input_ids=tokens).logits[0]
        nll = torch.nn.functional.cross_entropy(logits[:-1], tokens[0, 1:])
        out[key] = (logits, float(torch.exp(nll)))
    return {"max_abs_logit_diff": float((out["dense"][0] - out["moe"][0]).abs().max()),
            "dense_ppl": out["dense"][1], "moe_ppl": out["moe"][1]}


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("out", type=Path)
    ap.add_argument("--top-k", type=int, default=4)


def run(args: argparse.Namespace) -> int:
    build(args.out, args.top_k)
    print(f"wrote {args.out} (top-{args.top_k} of {EXPERTS} experts)")
    return 0


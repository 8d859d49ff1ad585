"""Helpers several test modules share: random windows, a family's tiny model loaded, a
calibration dataset, llm-compressor's oneshot with one preset, a model of no known
family, a uniform plan saved or written as a checkpoint, the modules a checkpoint's
transform_config rotates, a mixed plan over a model's units and a copy of its weights
(the QAD tests)."""

from __future__ import annotations

import torch

#: how a CPU run calibrates a bf16 base (plan.json's ``calibration``)
FP32 = {"dtype": "float32", "stored_dtype": "bfloat16", "window_prefix": []}


def random_windows(n=3, length=64, seed=0) -> torch.Tensor:
    """``n`` windows of ``length`` random token ids (SmolLM2's vocabulary)."""
    return torch.randint(0, 49152, (n, length), generator=torch.Generator().manual_seed(seed))


def family_model(path, family: str = "llama", dtype=torch.float32):
    """A tiny random model of ``family`` (tests/families.py) saved at ``path``, loaded."""
    from transformers import AutoModelForCausalLM

    from families import make_family_model

    make_family_model(family, path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def calibration_dataset(tokenizer_dir, n=4, length=64):
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 49152, (n, length), generator=g)
    mask = torch.ones_like(ids)
    return Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": mask.tolist()})


def oneshot_checkpoint(model_dir, scheme, out_dir, dataset=None, recipe=None):
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    import fp4sense_llmcompressor  # noqa: F401

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    recipe = recipe or QuantizationModifier(targets=["Linear"], scheme=scheme, ignore=["lm_head"])
    kwargs = {}
    if dataset is not None:
        kwargs = dict(dataset=dataset, num_calibration_samples=len(dataset), max_seq_length=64)
    oneshot(model=model, recipe=recipe, **kwargs)
    model.save_pretrained(out_dir, save_compressed=True)
    return out_dir


def uniform_checkpoint(base, calib, units, scheme: str, work, calibration: dict | None):
    """``base`` with every unit ``scheme``, through the registered quantizer (the plugin's
    oneshot), calibrated as ``calibration`` says."""
    from fp4sense.quantization.rounded import uniform_plan
    from fp4sense.runtime.hosts import quantizer

    work.mkdir(parents=True)
    uniform_plan(units, scheme, "tiny", "", calibration).save(work / "plan.json")
    recipe = quantizer()(str(base), calib, work, plan="plan.json")
    return recipe


def uniform_plan_file(model_dir, text_file, scheme: str, path):
    """Every unit of ``model_dir`` under ``scheme``, calibrated in float32 (:data:`FP32`),
    saved at ``path``; returns the 4 calibration windows of 64 tokens from ``text_file``
    and the units."""
    from fp4sense.inputs.models import analysis_windows, load_model
    from fp4sense.quantization.rounded import uniform_plan
    from fp4sense.structure.units import find_units, model_fingerprint

    model, tok, _ = load_model(model_dir)
    calib = analysis_windows(tok, text_file, 4, 64)
    units = find_units(model, calib[:1, :16])
    uniform_plan(units, scheme, "tiny", model_fingerprint(model), FP32).save(path)
    return calib, units


def transform_targets(model_dir, quantization_config: dict) -> dict[str, int]:
    """Module -> rotation width, for every module of ``model_dir`` that the checkpoint's
    ``transform_config`` rotates (compressed-tensors' own target matching)."""
    from compressed_tensors.utils import match_named_modules
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    groups = (quantization_config.get("transform_config") or {}).get("config_groups", {})
    return {name: group["head_dim"] for group in groups.values()
            for args in group["apply"][:1]
            for name, _ in match_named_modules(model, args["targets"], args["ignore"])}


class ToyBlock(torch.nn.Module):
    """A decoder block of no known family: other names, other nesting."""

    def __init__(self, d=64):
        super().__init__()
        self.ln_a, self.ln_b = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.to_q, self.to_k, self.to_v = (torch.nn.Linear(d, d) for _ in range(3))
        self.to_out = torch.nn.Linear(d, d)
        self.ffn = torch.nn.ModuleDict({"w1": torch.nn.Linear(d, 2 * d),
                                        "w3": torch.nn.Linear(d, 2 * d),
                                        "w2": torch.nn.Linear(2 * d, d)})

    def forward(self, x):
        h = self.ln_a(x)
        att = torch.nn.functional.scaled_dot_product_attention(
            self.to_q(h), self.to_k(h), self.to_v(h), is_causal=True)
        x = x + self.to_out(att)
        h = self.ln_b(x)
        return x + self.ffn["w2"](torch.nn.functional.silu(self.ffn["w1"](h))
                                  * self.ffn["w3"](h))


class ToyLM(torch.nn.Module):
    def __init__(self, vocab=256, d=64, n=3):
        super().__init__()
        torch.manual_seed(0)
        self.tok = torch.nn.Embedding(vocab, d)
        self.trunk = torch.nn.ModuleList(ToyBlock(d) for _ in range(n))
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def get_input_embeddings(self):
        return self.tok

    def forward(self, input_ids):
        x = self.tok(input_ids)
        for block in self.trunk:
            x = block(x)
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.head(x))


def base_pass_inputs(model_dir, name: str, rotations=()):
    """An Analysis of ``model_dir`` (float32, 2 random windows) after its base pass, and
    the inputs the linear ``name`` saw in it (rows): (run, units, inputs)."""
    from transformers import AutoModelForCausalLM

    from fp4sense.diagnosis.cache import EntryCache
    from fp4sense.diagnosis.engine import Analysis
    from fp4sense.structure.units import find_units

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    windows = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(0))
    units = find_units(model, windows[:1, :16])
    run = Analysis(model, windows, units, EntryCache(None), False)
    run.rotations = tuple(rotations)
    seen = []
    handle = run.modules[name].register_forward_pre_hook(
        lambda _m, args: seen.append(args[0].detach().reshape(-1, args[0].shape[-1])))
    run.base_pass()
    handle.remove()
    return run, units, torch.cat(seen)


def mixed_plan_setup(path):
    """A model of ``path`` in float32, 4 random windows of 48 tokens, its units, and a mixed
    plan over them (W4A4 NVFP4 with searched scales, W4A4 NVFP4, FP8, and the last unit
    left in BF16); the last unit's name comes last."""
    from transformers import AutoModelForCausalLM

    from fp4sense.structure.units import find_units

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    windows = torch.randint(0, 2000, (4, 48), generator=torch.Generator().manual_seed(1))
    units = find_units(model, windows[:1, :16])
    names = [u.name for u in units.units]
    schemes = {n: ("NVFP4_SEARCH", "NVFP4", "FP8_DYNAMIC")[i % 3] for i, n in enumerate(names)}
    schemes[names[-1]] = "BF16"
    return model, units, schemes, windows, names[-1]


def weights_of(model) -> dict:
    """A copy of every tensor of ``model``'s state."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def one_line(proc, code: int, *culprits: str) -> str:
    """A command's result: exit ``code``, no traceback, one error line naming every
    culprit; that line."""
    assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert len(errors) == 1, proc.stderr[-2000:]
    for culprit in culprits:
        assert culprit in errors[0], (culprit, errors[0])
    return errors[0]

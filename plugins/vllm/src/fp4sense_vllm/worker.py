"""Run a checkpoint in vLLM and report prompt log-probs (``fp4sense verify-vllm``'s serve half).

Runs in the serve environment, as a separate process from the quantize environment
(like a real deployment)::

    python -m fp4sense_vllm.worker JOB.json RESULT.json [JOB2.json RESULT2.json ...]

Several jobs run one after another in the same process (vLLM is imported once; each
checkpoint gets its own engine, freed before the next).

JOB: {"model": dir, "windows": [[token ids]], "prompt": str, "max_tokens": int,
      "dtype": "float32" | "bfloat16", "max_model_len": int}
RESULT: {"logprobs": [[logprob of token t given tokens < t, for t = 1..T-1]],
         "completion": str, "vllm": version, "plugin_registered": bool}
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> int:
    if not argv or len(argv) % 2:
        print("usage: python -m fp4sense_vllm.worker JOB.json RESULT.json [...]",
              file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    for job_path, result_path in zip(argv[::2], argv[1::2], strict=True):
        _run(job_path, result_path)
    return 0


def _run(job_path: str, result_path: str) -> None:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    import fp4sense_vllm

    with open(job_path) as fh:
        job = json.load(fh)
    llm = LLM(model=job["model"], dtype=job.get("dtype", "float32"),
              max_model_len=job.get("max_model_len", 1024), enforce_eager=True,
              seed=0, enable_prefix_caching=False)
    scoring = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in job["windows"]], scoring,
                           use_tqdm=False)
    logprobs = []
    for ids, out in zip(job["windows"], outputs, strict=True):
        # prompt_logprobs[0] is None (no context); entry t maps token ids -> Logprob
        row = [entry[token].logprob for token, entry in zip(ids[1:], out.prompt_logprobs[1:],
                                                              strict=True)]
        logprobs.append(row)
    completion = ""
    if job.get("prompt"):
        greedy = SamplingParams(max_tokens=job.get("max_tokens", 16), temperature=0.0)
        completion = llm.generate([job["prompt"]], greedy, use_tqdm=False)[0].outputs[0].text
    with open(result_path, "w") as fh:
        json.dump({"logprobs": logprobs, "completion": completion, "vllm": vllm.__version__,
                   "plugin_registered": fp4sense_vllm.registered()}, fh)
    del llm
    cleanup_dist_env_and_memory()  # the next job's engine starts from a clean state


if __name__ == "__main__":  # vLLM spawns processes: the guard is required
    sys.exit(main(sys.argv[1:]))

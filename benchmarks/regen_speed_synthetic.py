"""Continuous-batching decode speed on a random-weight SmolLM2-135M-shaped target (speed does not
depend on weight values): generated tokens/s with and without the CUDA graph, same process.
Usage: python benchmarks/regen_speed_synthetic.py [slots] [max_prompt_tokens] [max_new_tokens]"""

import json
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash_trainer.decoding.continuous import ContinuousGenerator
from dflash_trainer.target_model.load import bundle_from_model


def main() -> None:
    slots, max_prompt, max_new = (int(x) for x in (sys.argv[1:] + ["512", "1536", "256"][len(sys.argv) - 1:])[:3])
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000,
                      tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    bundle = bundle_from_model(model, name_or_path="random-smollm2-shape")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 49000, (int(n),), generator=g).tolist()
               for n in torch.randint(60, 400, (2 * slots,), generator=g)]
    out = {"slots": slots, "max_prompt_tokens": max_prompt, "max_new_tokens": max_new, "prompts": len(prompts)}
    for graph in (True, False):
        gen = ContinuousGenerator(bundle, slots=slots, max_prompt_tokens=max_prompt, max_new_tokens=max_new,
                                  eos_ids={0}, cuda_graph=graph, row_attention=False, overlap=False)
        for i, p in enumerate(prompts):
            gen.submit(i, p)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = 0
        while gen.busy:
            n += sum(len(f.tokens) for f in gen.poll())
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        out["graph" if graph else "eager"] = {"tokens": n, "wall_s": dt, "tokens_per_s": n / dt, "steps": gen.steps,
                                               "ms_per_step": 1000 * dt / gen.steps, "captured": gen.graph is not None}
        del gen
        torch.cuda.empty_cache()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

"""generate() of a Hugging Face MoE model whose experts are served by moe-rankd ranks.

Start the ranks on the model's checkpoint directory first (one per GPU; see README "Run a local
cluster"), then:

  python3 python/examples/hf_generate.py --model DIR --targets unix:/tmp/moe/0.sock,unix:/tmp/moe/1.sock \
      [--prompt "text"] [--new_tokens 32] [--rings]

The router, attention, shared experts and the rest run here; each MoE layer step goes to every
rank once (moe_runtime.hf.attach). Without a tokenizer in DIR the prompt is random token ids.
"""
import argparse
import time

import torch
import transformers

from moe_runtime import RankGroup
from moe_runtime.hf import attach


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="the checkpoint directory the ranks serve")
    p.add_argument("--targets", required=True, help="the ranks' engine sockets, rank order, comma-separated")
    p.add_argument("--prompt", default="The expert-parallel runtime")
    p.add_argument("--new_tokens", type=int, default=32)
    p.add_argument("--rings", action="store_true", help="co-located ranks: steps through step rings")
    a = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).to(device).eval()
    try:
        tok = transformers.AutoTokenizer.from_pretrained(a.model)
        ids = tok(a.prompt, return_tensors="pt").input_ids.to(device)
    except Exception:
        tok = None
        ids = torch.randint(1, model.config.vocab_size, (1, 16), device=device)
    group = RankGroup(a.targets.split(","), timeout=120)
    if a.rings:
        group.use_rings(max_tokens=4096, d=model.config.hidden_size, k=model.config.num_experts_per_tok)
    attach(model, group)  # the experts' weights leave this process; the ranks serve them
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=a.new_tokens, do_sample=False)
    seconds = time.perf_counter() - start
    new = out[0, ids.shape[1]:]
    print(tok.decode(new) if tok is not None else new.tolist())
    print(f"{len(new)} tokens in {seconds:.2f} s through {group.size} ranks ({group.retried} steps retried)")
    group.close()


if __name__ == "__main__":
    main()

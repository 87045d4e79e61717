"""The two assets torchtitan's llama3 debug model reads, made offline and deterministically
(nothing copied from torchtitan's repository, nothing downloaded): a byte-level BPE tokenizer
(``tokenizer/tokenizer.json`` + ``tokenizer_config.json``, vocabulary < 2048, the debug
model's) and a JSON-lines text data set (``c4_test/data.json``, field ``text``), which
torchtitan's ``c4_test`` loader reads with ``load_dataset(path)``.

Usage: python -m tools.stacks.titan_assets OUTDIR
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
SYL = ["ka", "lo", "mi", "ne", "ru", "ta", "shi", "po", "ve", "dan", "tor", "el",
       "qua", "zen", "bri", "gol", "fa", "um", "ix", "or", "sa", "the", "ing", "ed"]


def make(out: Path, docs: int = 400) -> tuple[Path, Path]:
    """(tokenizer directory, data set directory) under ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    rng = random.Random(1234)
    words = ["".join(rng.choice(SYL) for _ in range(rng.randint(1, 3))) for _ in range(3000)]

    def doc(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n)) + "."

    texts = [doc(rng.randint(100, 400)) for _ in range(docs)]
    tok_dir, data_dir = out / "tokenizer", out / "c4_test"
    tok_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "data.json").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    tok.train_from_iterator(texts[:200], trainer=trainers.BpeTrainer(
        vocab_size=2000, special_tokens=[BOS, EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert tok.get_vocab_size() <= 2048, tok.get_vocab_size()
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": False,
        "model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return tok_dir, data_dir


if __name__ == "__main__":
    make(Path(sys.argv[1]))

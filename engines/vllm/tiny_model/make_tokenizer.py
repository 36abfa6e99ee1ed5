"""Regenerate ``tokenizer.json`` for the tiny test model (run with any python that has ``tokenizers``).

The tokenizer is a byte-level BPE (every string encodes, nothing is unknown) trained on
``corpus.txt``, text shipped beside this script (gpuhit's own README and docs, Apache-2.0). It is small
(2,048 tokens) so the model's 32,000-token embedding covers it. The chat template lives in
``tokenizer_config.json``. vLLM loads both through transformers' ``PreTrainedTokenizerFast``; gpuhit's
gateway loads the same two files with ``tokenizers`` + jinja2, so both sides produce identical token ids.

    .venv-vllm/bin/python engines/vllm/tiny_model/make_tokenizer.py
"""

from __future__ import annotations

import pathlib

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = pathlib.Path(__file__).resolve().parent
SPECIAL = ["<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def main() -> None:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2048, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(HERE / "corpus.txt")], trainer)
    tok.save(str(HERE / "tokenizer.json"))
    print(f"vocab {tok.get_vocab_size()} -> {HERE / 'tokenizer.json'}")


if __name__ == "__main__":
    main()

"""The testbed's character-level tokenizer, built offline as a Hugging Face fast tokenizer.

Using a real ``PreTrainedTokenizerFast`` keeps the trainer's code path identical for the testbed
and for Qwen3 checkpoints: same padding, same special tokens, same decode.
"""
from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = [PAD, BOS, EOS, UNK]
#: Printable ASCII plus newline: enough for arithmetic, short code and the testbed's templates.
CHARS = sorted(set(string.printable) - set("\t\r\x0b\x0c"))


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character; ids 0–3 are the special tokens. Pads on the left for generation."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()  # join characters back without the spaces WordLevel would insert
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS,
                                  unk_token=UNK, padding_side="left", clean_up_tokenization_spaces=False)
    return tok


"""Anvil's data pipeline: prepare token shards, read them back in batches, inspect them.

    prepare(inputs, out, tokenizer="byte", ...)   corpus -> dataset dir (prepare.py)
    train_tokenizer(inputs, out, vocab_size)       byte-level BPE on a corpus -> tokenizer.json
    TokenLoader(path, split, seq_len, batch_size, rank, world_size, seed)
    SyntheticLoader(vocab_size, seq_len, batch_size, rank, world_size, seed)
    BlendLoader(sources, split, seq_len, batch_size, rank, world_size, seed)   weighted datasets as one stream
    load_tokenizer(dataset_dir)                    the tokenizer a dataset was made with
    inspect_dataset(dataset_dir)                   counts, length histogram, decoded samples
    inspect_blend(sources, seq_len, samples)       a blend's shares, tokens and epochs over a run
    DataError                                      problems a user can fix (exit 2)
    Interrupted                                    Ctrl-C stopped a build; partial output removed (exit 130)
"""
from .blend import BlendLoader
from .dataset import Dataset, read_manifest
from .errors import DataError, Interrupted
from .inspect import inspect_blend, inspect_dataset
from .loader import SyntheticLoader, TokenLoader
from .bpe import train_tokenizer
from .prepare import prepare
from .tokenizers import ByteTokenizer, get_tokenizer, load_tokenizer

__all__ = ["BlendLoader", "ByteTokenizer", "DataError", "Dataset", "Interrupted", "SyntheticLoader", "TokenLoader",
           "get_tokenizer", "inspect_blend", "inspect_dataset", "load_tokenizer", "prepare", "read_manifest",
           "train_tokenizer"]

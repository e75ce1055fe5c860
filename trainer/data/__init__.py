"""Anvil's data pipeline: prepare token shards, read them back in batches, inspect them.

    prepare(inputs, out, tokenizer="byte", ...)   corpus -> dataset dir (prepare.py)
    TokenLoader(path, split, seq_len, batch_size, rank, world_size, seed)
    SyntheticLoader(vocab_size, seq_len, batch_size, rank, world_size, seed)
    load_tokenizer(dataset_dir)                    the tokenizer a dataset was made with
    DataError                                      problems a user can fix
"""
from .dataset import Dataset, read_manifest
from .errors import DataError
from .loader import SyntheticLoader, TokenLoader
from .tokenizers import ByteTokenizer, get_tokenizer, load_tokenizer

__all__ = ["ByteTokenizer", "DataError", "Dataset", "SyntheticLoader", "TokenLoader",
           "get_tokenizer", "load_tokenizer", "read_manifest"]


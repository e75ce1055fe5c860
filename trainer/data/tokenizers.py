"""Tokenizers: the dependency-free byte tokenizer (the default), BPE trained with
Hugging Face `tokenizers`, and any tokenizer.json on disk (e.g. Llama 3's).

Every tokenizer has the same small surface: encode(str) -> list[int] (no
specials), decode(list[int]) -> str, vocab_size, bos_id, eos_id, pad_id and
spec() (what the manifest records). Nothing is ever fetched from a hub.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable

import numpy as np

from core.files import sha256_file, text_of

from .errors import DataError

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)

# Names other tokenizer.json files use for the same roles, tried in order.
_BOS_NAMES = (BOS_TOKEN, "<s>", "<bos>", "<|startoftext|>", "<|endoftext|>")
_EOS_NAMES = (EOS_TOKEN, "</s>", "<eos>", "<|endoftext|>", "<|eot_id|>")
_PAD_NAMES = (PAD_TOKEN, "<pad>", "<|finetune_right_pad_id|>", "[PAD]")


class ByteTokenizer:
    """UTF-8 bytes are the tokens 0..255; BOS, EOS, PAD are 256, 257, 258."""

    kind = "byte"
    bos_id, eos_id, pad_id = 256, 257, 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def encode_many(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        names = {self.bos_id: BOS_TOKEN, self.eos_id: EOS_TOKEN, self.pad_id: PAD_TOKEN}
        out, run = [], bytearray()
        for i in ids:
            i = int(i)
            if i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            out.append(names.get(i, f"<|unk_{i}|>"))
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def spec(self) -> dict:
        return {"kind": "byte", "vocab_size": self.vocab_size, "bos_id": self.bos_id,
                "eos_id": self.eos_id, "pad_id": self.pad_id}


class JsonTokenizer:
    """A Hugging Face tokenizer.json (our own trained BPE, or any other on disk)."""

    def __init__(self, path: Path, kind: str = "json"):
        from tokenizers import Tokenizer

        self.path = Path(path)
        self.kind = kind
        if not self.path.is_file():
            raise DataError(f"tokenizer file not found: {self.path}")
        expected = "expected a Hugging Face tokenizer.json"
        try:
            data = self.path.read_bytes()
        except OSError as exc:
            raise DataError(f"cannot read the tokenizer {self.path} ({exc.strerror or exc})") from None
        text, where = text_of(data)
        if text is None:
            raise DataError(f"tokenizer {self.path} is not a text file ({where}); {expected}")
        try:
            json.loads(text)
        except ValueError as exc:
            raise DataError(f"tokenizer {self.path} is not JSON ({exc}); {expected}") from None
        try:
            self._tok = Tokenizer.from_str(text)
        except Exception as exc:  # tokenizers raises a bare Exception on a wrong structure
            raise DataError(f"cannot load the tokenizer {self.path} ({exc}); {expected}") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._find(_BOS_NAMES)
        self.eos_id = self._find(_EOS_NAMES)
        if self.eos_id is None:
            raise DataError(f"tokenizer {self.path} has no end-of-text token "
                            f"(looked for {', '.join(_EOS_NAMES)}); documents need a separator")
        pad = self._find(_PAD_NAMES)
        self.pad_id = self.eos_id if pad is None else pad
        self.sha256 = sha256_file(self.path)

    def _find(self, names) -> int | None:
        for name in names:
            i = self._tok.token_to_id(name)
            if i is not None:
                return i
        return None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.uint32)

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """Token ids of many texts at once, on the fast path: no offsets, no token strings."""
        encode = getattr(self._tok, "encode_batch_fast", None) or self._tok.encode_batch
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def spec(self) -> dict:
        return {"kind": self.kind, "vocab_size": self.vocab_size, "bos_id": self.bos_id,
                "eos_id": self.eos_id, "pad_id": self.pad_id, "path": "tokenizer.json",
                "source": str(self.path), "sha256": self.sha256}


_PIECE_PROBES = (("def f(x):\n    return x\n", "print(f(1))\n"), ("Hello, world.\n\nSecond.\n", "A new paragraph"),
                 ("1234567\n", "89 tokens"), ("\u65e5\u672c\u8a9e\u306e\u6587\u3002\n", "\u6b21\u306e\u884c"),
                 ("  indented\n", "x = {'a': [1, 2]}"))


def splits_at_newlines(tok) -> bool:
    """Whether `tok` gives a text's tokens when the text is cut right after a newline with a
    non-space on both sides and the pieces are tokenized apart (formats/text.py cuts long files
    there). True of byte-level BPEs and Llama 3's; not of tokenizers that mark the start of
    the input (SentencePiece's prefix space): those get their documents whole."""
    for a, b in _PIECE_PROBES:
        if [int(i) for i in tok.encode(a + b)] != [int(i) for i in tok.encode(a)] + [int(i) for i in tok.encode(b)]:
            return False
    return True


def get_tokenizer(name: str | Path):
    """"byte" or a path to a tokenizer.json (prepare trains "bpe" itself first)."""
    if str(name) == "byte":
        return ByteTokenizer()
    path = Path(name)
    if path.is_dir():
        path = path / "tokenizer.json"
    kind = "bpe" if _is_our_bpe(path) else "json"
    return JsonTokenizer(path, kind=kind)


def _is_our_bpe(path: Path) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return False
    return bool(data.get("model", {}).get("type") == "BPE"
                and [t.get("content") for t in data.get("added_tokens", [])][:3] == list(SPECIAL_TOKENS))


def load_tokenizer(dataset_dir: str | Path):
    """The tokenizer a prepared dataset was made with (from its manifest.json)."""
    from .dataset import read_manifest

    dataset_dir = Path(dataset_dir)
    spec = read_manifest(dataset_dir)["tokenizer"]  # checked: a dict with kind and vocab_size
    if spec["kind"] == "byte":
        return ByteTokenizer()
    file = dataset_dir / str(spec.get("path") or "tokenizer.json")
    if not file.is_file():
        raise DataError(f"dataset {dataset_dir} was made with a {spec['kind']} tokenizer but its "
                        f"{file.name} is missing; prepare it again with --force")
    tok = JsonTokenizer(file, kind=spec["kind"])
    if spec.get("sha256") and tok.sha256 != spec["sha256"]:
        raise DataError(f"{tok.path} does not match the manifest (sha256 differs); "
                        f"the dataset was modified, prepare it again")
    return tok


def train_bpe(texts: Iterable[str], vocab_size: int, out: Path, min_frequency: int = 2,
              show_progress: bool = False) -> JsonTokenizer:
    """Train a byte-level BPE tokenizer on texts and save it to out (atomically)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise DataError(f"--vocab-size {vocab_size} is too small: a byte-level BPE needs at "
                        f"least {256 + len(SPECIAL_TOKENS)} (256 bytes + {len(SPECIAL_TOKENS)} specials)")
    from core.files import write_atomic
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS), show_progress=show_progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    out = Path(out)
    write_atomic(out, tok.to_str(pretty=True))  # a unique temp file beside it, fsync, rename
    return JsonTokenizer(out, kind="bpe")

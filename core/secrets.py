"""Secret masking for everything written into a run directory or a log.

Stdlib only: trainer.ranklog (which the trainer imports) uses it too.

Three layers, because a secret leaks through whichever one is missing:
1. names: variables/keys/flags whose names look secret get their value masked
   (TOKEN, SECRET, PASSWORD, KEY, ... as parts of the name);
2. shapes: credentials inside URLs (``https://user:pass@host``);
3. values: every secret value known to the process (taken from os.environ by
   name) is replaced wherever it appears in text - a token echoed into a log
   line or pasted into a config is caught even under a harmless name.
"""
from __future__ import annotations

import os
import re
from typing import Any, Iterable, Mapping

from core import names

MASK = "<masked>"

# Substring match on environment variable names (case-insensitive), as in the
# reference's recommendation: over-masking a harmless name costs nothing.
SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASS|AUTH|CREDENTIAL|COOKIE|SIGNATURE|PRIVATE|_URL|DSN",
                         re.IGNORECASE)
# Tuning-variable families recorded in full: their names contain words like KEY
# or PASS for harmless reasons (NCCL_IB_PKEY, ...). Masked only if the name
# carries an unambiguous secret word.
SAFE_PREFIXES = ("NCCL_", "RCCL_", "HSA_", "HIP_", "ROCR_", "CUDA_", "SLURM_", "TORCH", "PYTORCH_",
                 "OMP_", "MASTER_", "MIOPEN_", names.GPU + "_", "TOKENIZERS_")
STRONG_SECRET_NAME = re.compile(r"TOKEN(?!IZER)|SECRET|PASSWORD|PASSWD|CREDENTIAL|PRIVATE|COOKIE",
                                re.IGNORECASE)

# Config keys and CLI flags are matched per word, because config vocabulary is
# full of harmless substrings ("tokenizer", "max_tokens", "keep_last").
SECRET_WORDS = {"token", "apikey", "key", "secret", "secrets", "password", "passwd", "pass",
                "passphrase", "auth", "authorization", "credential", "credentials", "cookie",
                "cookies", "signature", "private", "dsn"}

# user:password@ right after a "://": matched only where a "://" is (see _mask_urls), so that a
# long word without one costs nothing and a long one costs one pass, never a pass per start
URL_USERINFO = re.compile(r"[^/\s:@]+:([^/\s@]+)@")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Secret values of MIN_LITERAL characters or more are replaced wherever they appear; shorter
# ones (down to MIN_WORD) only as a whole word, so a short password is hidden without every
# "1" or "abc" inside unrelated text being mangled. Common words are never secrets.
MIN_LITERAL = 6
MIN_WORD = 3
_BORING = {"true", "false", "none", "null", "enabled", "disabled", "yes", "off"}


def is_secret_env_name(name: str) -> bool:
    if any(name.upper().startswith(p) for p in SAFE_PREFIXES):
        return bool(STRONG_SECRET_NAME.search(name))
    return bool(SECRET_NAME.search(name))


def _words(name: str) -> list[str]:
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)
    return [w for w in re.split(r"[^A-Za-z0-9]+", spaced.lower()) if w]


def is_secret_key(name: str) -> bool:
    """For config keys and option names: secret if one of its words is."""
    if ENV_NAME.match(name) and name.upper() == name and "_" in name:
        return is_secret_env_name(name)   # an env-style name inside a config (env: blocks)
    words = _words(name)
    if any(w in SECRET_WORDS for w in words):
        return True
    # fused forms: apikey, authtoken, api_key -> ["api","key"] handled above
    return any(w.endswith(("token", "secret", "password", "passwd")) for w in words)


def is_maskable_literal(value: str) -> bool:
    value = value.strip()
    return (len(value) >= MIN_LITERAL and value.lower() not in _BORING
            and not re.fullmatch(r"[0-9.:,/ -]+", value))


def is_maskable_word(value: str) -> bool:
    """A short secret value masked where it stands as a word of its own."""
    value = value.strip()
    return MIN_WORD <= len(value) < MIN_LITERAL and value.lower() not in _BORING


def _mask_urls(text: str) -> str:
    """scheme://user:PASSWORD@host -> scheme://user:<masked>@host, in one pass over the text."""
    if "://" not in text:
        return text
    out, start = [], 0
    for at in _occurrences(text, "://"):
        found = URL_USERINFO.match(text, at + 3)
        if found:
            out.append(text[start:found.start(1)])
            out.append(MASK)
            start = found.end(1)
    out.append(text[start:])
    return "".join(out)


def _occurrences(text: str, needle: str):
    at = text.find(needle)
    while at >= 0:
        yield at
        at = text.find(needle, at + len(needle))


class Masker:
    """Masks text, mappings and argv; knows the literal secret values to hide."""

    def __init__(self, secret_values: Iterable[str] = ()):
        self._values: set[str] = set()
        self._words: set[str] = set()
        self._ordered: list[str] = []
        self._word_pattern = None
        self.add_values(secret_values)

    @classmethod
    def from_environ(cls, *environs: Mapping[str, str] | None) -> "Masker":
        """Collect secret values from os.environ plus any extra env mappings."""
        masker = cls()
        for env in (os.environ, *environs):
            masker.add_env(env or {})
        return masker

    def add_env(self, env: Mapping[str, Any]) -> None:
        self.add_values(str(v) for k, v in env.items() if is_secret_env_name(str(k)) and v is not None)

    def add_values(self, values: Iterable[str]) -> None:
        for value in values:
            value = str(value)
            if is_maskable_literal(value):
                self._values.add(value)
                self._values.add(value.strip())
            elif is_maskable_word(value):
                self._words.add(value.strip())
        self._ordered = sorted(self._values, key=len, reverse=True)
        if self._words:   # (?<![\w]) ... (?![\w]): the value as a word, not inside another one
            self._word_pattern = re.compile(r"(?<!\w)(?:" + "|".join(
                re.escape(w) for w in sorted(self._words, key=len, reverse=True)) + r")(?!\w)")

    @property
    def values(self) -> frozenset[str]:
        return frozenset(self._values | self._words)

    def text(self, text: str) -> str:
        """`text` with every known secret value and URL password masked; linear in its length."""
        if not text:
            return text
        for value in self._ordered:
            if value in text:
                text = text.replace(value, MASK)
        if self._word_pattern is not None:
            text = self._word_pattern.sub(MASK, text)
        return _mask_urls(text)

    def env(self, env: Mapping[str, Any]) -> dict[str, Any]:
        return {k: (MASK if is_secret_env_name(str(k)) and v not in (None, "") else self.value(v))
                for k, v in env.items()}

    def value(self, value: Any) -> Any:
        return self.text(value) if isinstance(value, str) else value

    def mapping(self, obj: Any) -> Any:
        """Deep copy of a config-like object with secret keys' values masked."""
        if isinstance(obj, Mapping):
            out = {}
            for k, v in obj.items():
                key = self.text(k) if isinstance(k, str) else k
                if is_secret_key(str(k)) and not isinstance(v, (Mapping, list, tuple)) and v not in (None, ""):
                    out[key] = MASK
                else:
                    out[key] = self.mapping(v)
            return out
        if isinstance(obj, (list, tuple)):
            return [self.mapping(v) for v in obj]
        return self.value(obj)

    def argv(self, argv: Iterable[str]) -> list[str]:
        """--token=X, --token X, KEY=VALUE (secret names) and known values masked."""
        out: list[str] = []
        mask_next = False
        for arg in argv:
            arg = str(arg)
            if mask_next:
                mask_next = False
                if not arg.startswith("-"):     # a boolean flag takes no value
                    out.append(MASK)
                    continue
            if arg.startswith("-") and not arg.startswith("---"):
                flag, eq, value = arg.lstrip("-").partition("=")
                if flag and is_secret_key(flag):
                    if eq:
                        out.append(f"{arg.split('=', 1)[0]}={MASK}")
                    else:
                        mask_next = True
                        out.append(arg)
                    continue
            elif "=" in arg:
                key, _, value = arg.partition("=")
                if key and (is_secret_env_name(key) if ENV_NAME.match(key) else is_secret_key(key)):
                    out.append(f"{key}={MASK}")
                    continue
            out.append(self.text(arg))
        return out


def mask_text(text: str) -> str:
    """Convenience: mask with the secrets of the current process environment."""
    return Masker.from_environ().text(text)

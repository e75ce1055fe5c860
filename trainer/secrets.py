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

MASK = "<masked>"

# Substring match on environment variable names (case-insensitive), as in the
# reference's recommendation: over-masking a harmless name costs nothing.
SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASS|AUTH|CREDENTIAL|COOKIE|SIGNATURE|PRIVATE|_URL|DSN",
                         re.IGNORECASE)
# Tuning-variable families recorded in full: their names contain words like KEY
# or PASS for harmless reasons (NCCL_IB_PKEY, ...). Masked only if the name
# carries an unambiguous secret word.
SAFE_PREFIXES = ("NCCL_", "RCCL_", "HSA_", "HIP_", "ROCR_", "CUDA_", "SLURM_", "TORCH", "PYTORCH_",
                 "OMP_", "MASTER_", "MIOPEN_", "ANVIL_GPU_", "TOKENIZERS_")
STRONG_SECRET_NAME = re.compile(r"TOKEN(?!IZER)|SECRET|PASSWORD|PASSWD|CREDENTIAL|PRIVATE|COOKIE",
                                re.IGNORECASE)

# Config keys and CLI flags are matched per word, because config vocabulary is
# full of harmless substrings ("tokenizer", "max_tokens", "keep_last").
SECRET_WORDS = {"token", "apikey", "key", "secret", "secrets", "password", "passwd", "pass",
                "passphrase", "auth", "authorization", "credential", "credentials", "cookie",
                "cookies", "signature", "private", "dsn"}

URL_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^/\s:@]+):(?P<pw>[^/\s@]+)@")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Values too short or too common to be replaced as literals without mangling
# unrelated text ("1", "true", "/tmp").
MIN_LITERAL = 6
_BORING = {"true", "false", "none", "null", "enabled", "disabled"}


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


class Masker:
    """Masks text, mappings and argv; knows the literal secret values to hide."""

    def __init__(self, secret_values: Iterable[str] = ()):
        self._values: set[str] = set()
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
        self._ordered = sorted(self._values, key=len, reverse=True)

    @property
    def values(self) -> frozenset[str]:
        return frozenset(self._values)

    def text(self, text: str) -> str:
        if not text:
            return text
        for value in getattr(self, "_ordered", ()):
            if value in text:
                text = text.replace(value, MASK)
        return URL_CREDENTIALS.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", text)

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

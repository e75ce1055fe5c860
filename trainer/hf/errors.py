"""The errors of the Hugging Face package: a directory that cannot be started from, a model that
cannot be written as its family's transformers class. Both are UserErrors (exit 2)."""
from core.errors import UserError


class InitError(UserError):
    """A Hugging Face directory Anvil cannot start from, or one that does not fit the config
    (exit 2); the message names the file and what was expected."""


class InexpressibleModel(UserError):
    """A model config that the transformers class of its family cannot express (train.export:
    a Qwen3-MoE with shared experts, a DeepSeek-V2 with sigmoid scores); the message names the key."""

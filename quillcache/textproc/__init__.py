"""Text processing shared by the stand-in engine and the gateway: tokenizers, the chat template and prompt tokens.

Both sides import these so that a request's prompt becomes the same token ids on each (the gateway's block hashes
and the engine's block cache then cover the same tokens). See each module's docstring for its contract.
"""

from quillcache.textproc.chat import (
    CHAT_TEMPLATES,
    ROLES,
    ChatFormatError,
    ChatMLTemplate,
    ChatTemplate,
    JinjaChatTemplate,
    load_chat_template,
    normalize_messages,
)
from quillcache.textproc.prompt import (
    PromptError,
    PromptTokens,
    chat_prompt_tokens,
    completion_prompt_tokens,
    prompt_token_array,
    prompt_tokens,
)
from quillcache.textproc.tokenizer import (
    TOKENIZERS,
    ByteTokenizer,
    HfTokenizer,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
)

__all__ = [
    "CHAT_TEMPLATES",
    "ROLES",
    "TOKENIZERS",
    "ByteTokenizer",
    "ChatFormatError",
    "ChatMLTemplate",
    "ChatTemplate",
    "HfTokenizer",
    "JinjaChatTemplate",
    "PromptError",
    "PromptTokens",
    "Tokenizer",
    "TokenizerError",
    "chat_prompt_tokens",
    "completion_prompt_tokens",
    "load_chat_template",
    "load_tokenizer",
    "normalize_messages",
    "prompt_token_array",
    "prompt_tokens",
]

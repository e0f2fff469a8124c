from pagellm.model.attention.base import AttentionBackend, AttentionMetadata
from pagellm.model.attention.selector import BACKEND_NAMES, get_attention_backend

__all__ = ["BACKEND_NAMES", "AttentionBackend", "AttentionMetadata", "get_attention_backend"]

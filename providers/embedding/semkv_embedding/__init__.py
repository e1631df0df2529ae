"""semkv provider ``embedding``: donors whose text is semantically close (MiniLM + faiss).

Where the text comes from: ``DonorProvider.text_of`` -- the text a donor or request carries
when it carries one, else its token ids detokenized through ``ProviderContext.detokenize``
(the engine's tokenizer). Donors are detokenized in the provider's background thread, queries
in the lookup's thread, so the host's detokenizer must be thread-safe. Text never leaves the
provider: it is not logged, stored, or put in exceptions; only its vector is indexed.

Which text is embedded: the first ``max_text_chars`` characters (default 1,000, about the 256
word pieces all-MiniLM-L6-v2 reads), split into ``chunk_chars`` windows whose vectors are
averaged. Prompts that differ only after that window look identical to this provider; the
verifier decides what is actually reusable. Raising ``max_text_chars`` (e.g. to 4,000 with
``chunk_chars`` 1,000: four windows) sees further at a proportional lookup cost.

Importing this package is cheap: torch, sentence-transformers, faiss and numpy load when a
provider is built.
"""

from semkv_embedding.config import EmbeddingConfig
from semkv_embedding.provider import EmbeddingProvider

__all__ = ["EmbeddingConfig", "EmbeddingProvider"]

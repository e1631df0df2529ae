"""semkv: provider-neutral semantic KV-cache reuse for LLM serving.

Importing semkv is cheap: no torch, vLLM or provider library is imported here.
"""

from semkv.config import ConfigError, SemkvConfig
from semkv.hookspecs import hookimpl
from semkv.leases import Lease, LeaseTable
from semkv.namespace import Namespace
from semkv.provider import (
    DonorProvider,
    DonorRecord,
    LookupQuery,
    ProviderCapabilities,
    ProviderContext,
)
from semkv.types import (
    CachePolicy,
    Candidate,
    FallbackReason,
    Materialization,
    Mode,
    Provenance,
    QualityTier,
    SemanticKVMatch,
    SemanticLoadPlan,
)

__version__ = "0.1.0"

__all__ = [
    "CachePolicy",
    "Candidate",
    "ConfigError",
    "DonorProvider",
    "DonorRecord",
    "FallbackReason",
    "Lease",
    "LeaseTable",
    "LookupQuery",
    "Materialization",
    "Mode",
    "Namespace",
    "Provenance",
    "ProviderCapabilities",
    "ProviderContext",
    "QualityTier",
    "SemanticKVMatch",
    "SemanticLoadPlan",
    "SemkvConfig",
    "__version__",
    "hookimpl",
]

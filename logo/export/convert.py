"""The weight mapping between the native model and the Hugging Face layout lives in `logo.run.hf_layout` (the
exporter writes with it, `logo.run.hf` reads with it); this import path keeps working."""
from logo.run.hf_layout import (BUFFERS, LOGO_ONLY, from_hf, is_logo_only, native_name_to_hf, rope_perm,
                                to_hf)

__all__ = ["BUFFERS", "LOGO_ONLY", "from_hf", "is_logo_only", "native_name_to_hf", "rope_perm", "to_hf"]

"""Names every part of the Hugging Face adapter agrees on (a leaf module: no imports)."""

ATTN_NAME = "dsa_tilelang"  # the attn_implementation users pass
PATCH_KEY = "hf"  # patch keys: "hf.<model_type>" (see dsa_plugins.patches.attributes)
SUPPORTED_TRANSFORMERS = ("5.17.0", "6.0.0")  # [minimum, below)

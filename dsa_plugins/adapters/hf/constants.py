"""Names every part of the Hugging Face adapter agrees on (a leaf module: no imports)."""

ATTN_NAME = "dsa_tilelang"  # the attn_implementation users pass
PATCH_KEY = "hf"  # patch keys: "hf.<model_type>" (see dsa_plugins.patches.attributes)
SUPPORTED_TRANSFORMERS = ("5.17.0", "6.0.0")  # [minimum, below)
#: the model types on the absorbed-MLA path (models.MODELS says how each is patched): the indexers the indexer loss
#: and the fp8 index cache serve
V32_FAMILY = ("glm_moe_dsa", "deepseek_v32", "axk2", "hy_v4", "hy_v4_vl", "mistral_large4", "dots3_note")

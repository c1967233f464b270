"""Names every part of the Hugging Face adapter agrees on (a leaf module: no imports)."""

ATTN_NAME = "dsa_tilelang"  # the attn_implementation users pass
PATCH_KEY = "hf"  # patch keys: "hf.<model_type>" (see dsa_plugins.patches.attributes)
SUPPORTED_TRANSFORMERS = ("5.17.0", "6.0.0")  # [minimum, below)
#: the model types on the absorbed-MLA path (models.MODELS says how each is patched; a test keeps the two equal): the
#: indexers the indexer loss and the fp8 index cache serve
V32_FAMILY = ("glm_moe_dsa", "deepseek_v32", "axk2", "hy_v4", "hy_v4_vl", "mistral_large4", "dots3_note")
#: sparse models in transformers that dsa_plugins does not serve, with the reason: under dsa_tilelang they are refused
#: (``refuse_unsupported``) rather than run without their selection
UNSUPPORTED = {
    "minimax_m3_vl": "its indexer selects blocks of keys separately for each KV-head group (GQA, one selection per "
                     "group); the sparse ops take one token-level selection shared by every head",
    "qwen4_exp": "its QSA indexer selects compressed key blocks separately for each indexer KV head; the sparse ops "
                 "take one token-level selection shared by every head",
}


def refuse_unsupported(model_type: str | None) -> None:
    """Raise NotImplementedError for a model type in UNSUPPORTED (its text config's "<type>_text" too)."""
    base = (model_type or "").removesuffix("_text")
    if base in UNSUPPORTED:
        raise NotImplementedError(f"dsa_tilelang: {base} is not served by dsa_plugins: {UNSUPPORTED[base]}. Load it "
                                  "with attn_implementation='sdpa' or 'eager'.")

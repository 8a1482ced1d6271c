"""The Hugging Face model as gmtool runs it: loading, attention routing, fused layers, families, the FX split."""

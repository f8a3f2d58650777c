"""Ways to use flashtriton where code expects another package (flash_attn_module: `import flash_attn`;
transformers: an `attn_implementation` for Hugging Face transformers models; sdpa: a flash attention implementation
of PyTorch's scaled_dot_product_attention and varlen_attn)."""

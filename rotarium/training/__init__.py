"""Training: config, data, tokenizer, the accelerate loop (in progress)."""

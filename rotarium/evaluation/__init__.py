"""Evaluation of trained checkpoints: perplexity against context length, and text generation."""

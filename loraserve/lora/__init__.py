"""LoRA adapters: reading and validating PEFT adapters (kernels and batching come next)."""

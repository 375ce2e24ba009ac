"""Hugging Face checkpoints in and out: reading shards tensor by tensor, the import into our
params layout, the export back, and a streaming safetensors writer."""

"""The portable PyTorch engine: a Llama-family decoder with in-flight batching and speculative decoding."""

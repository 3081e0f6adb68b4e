"""What computes a forward: loading a frozen causal LM (any Hugging Face id or folder, or the embedded
GGUF), and the attention and linear backends the CPU profile runs."""

"""Native CPU kernels and their dispatch: few-query attention, GGUF-block linears, multi-lane SHA-256,
and the graft op's CPU twin. The lowest layer: it imports nothing of kvmemory but `errors` and `paths`."""

"""What every framework adapter shares: one memory per (model, store) and its lock."""

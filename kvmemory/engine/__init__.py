"""The exact graft engine: canonical runner (the reference), cache, graft, execution profile, verify."""

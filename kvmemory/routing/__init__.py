"""Routing questions to stored entries: a sentence embedder and FAISS indexes per namespace."""

"""Finding a compatible earlier request: model fingerprints, prompt embeddings, the shortlist index."""

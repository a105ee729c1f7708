"""mini-deepinfer deploy package."""

"""mini-deepinfer frontend package."""

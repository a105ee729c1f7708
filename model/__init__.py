"""mini-deepinfer model package."""

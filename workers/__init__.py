"""mini-deepinfer workers package."""

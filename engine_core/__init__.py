"""mini-deepinfer engine_core package."""

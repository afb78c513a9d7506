"""Tool calls: what a request offers, how the model is shown the functions, and how its replies are held to
and read back in its format."""

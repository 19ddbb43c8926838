"""Device kernels for the engine (Triton), each with a plain-torch reference of the same interface."""

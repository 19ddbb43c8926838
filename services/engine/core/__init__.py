"""The engine core: requests, scheduling, the step; no gRPC and no device code."""

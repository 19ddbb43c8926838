"""Generated gRPC stubs for protos/sluice/v1 (make protos). Do not edit."""

"""Edge: ONNX draft export, draft runtime, speculative decoding, offload routing, verifier service."""

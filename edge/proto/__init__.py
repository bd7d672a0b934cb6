"""Wire contract of the verifier service: `verifier.proto` and the stubs generated from it."""

"""Cloud verifier: batching engine (plain torch), gRPC servicer, and server lifecycle."""
